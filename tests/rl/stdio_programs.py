"""Programs in each language of the stdin/stdout judge, one per verdict.

The task: read two integers, print their sum. ``AC`` solves it, ``WA`` prints the
difference, ``TLE`` loops forever, ``MLE`` fills 1 GB, ``RE`` crashes, ``CE`` does not
compile (or, for the interpreted languages, does not parse).
"""

from __future__ import annotations

PROGRAMS: dict[str, dict[str, str]] = {
    "python": {
        "AC": "a, b = map(int, input().split())\nprint(a + b)\n",
        "WA": "a, b = map(int, input().split())\nprint(a - b)\n",
        "TLE": "while True:\n    pass\n",
        "MLE": "x = bytearray(1 << 30)\nfor i in range(0, len(x), 4096):\n    x[i] = 1\nprint(len(x))\n",
        "RE": "a, b = map(int, input().split())\nprint(a // 0)\n",
        "CE": "def f(:\n    pass\n",
    },
    "c": {
        "AC": "#include <stdio.h>\nint main(){long a,b;scanf(\"%ld %ld\",&a,&b);printf(\"%ld\\n\",a+b);return 0;}\n",
        "WA": "#include <stdio.h>\nint main(){long a,b;scanf(\"%ld %ld\",&a,&b);printf(\"%ld\\n\",a-b);return 0;}\n",
        "TLE": "int main(){volatile long i=0;for(;;)i++;}\n",
        "MLE": "#include <stdlib.h>\n#include <stdio.h>\nint main(){long n=1L<<30,s=0;char*p=malloc(n);"
               "for(long i=0;i<n;i+=4096)p[i]=(char)i;for(long i=0;i<n;i+=4096)s+=p[i];printf(\"%ld\\n\",s);return 0;}\n",
        "RE": "#include <stdio.h>\nint main(){int*p=0;*p=1;printf(\"%d\\n\",*p);return 0;}\n",
        "CE": "int main(){ return x; }\n",
    },
    "cpp": {
        "AC": "#include <iostream>\nint main(){long long a,b;std::cin>>a>>b;std::cout<<a+b<<\"\\n\";}\n",
        "WA": "#include <iostream>\nint main(){long long a,b;std::cin>>a>>b;std::cout<<a-b<<\"\\n\";}\n",
        "TLE": "int main(){volatile long i=0;for(;;)i++;}\n",
        "MLE": "#include <vector>\n#include <iostream>\nint main(){std::vector<char> v(1L<<30,1);std::cout<<(int)v[999]<<\"\\n\";}\n",
        "RE": "#include <stdexcept>\nint main(){throw std::runtime_error(\"boom\");}\n",
        "CE": "int main(){ undefined_function(); }\n",
    },
    "java": {
        "AC": "import java.util.*;\npublic class Main{public static void main(String[] a){Scanner s=new Scanner(System.in);"
              "long x=s.nextLong(),y=s.nextLong();System.out.println(x+y);}}\n",
        "WA": "import java.util.*;\npublic class Main{public static void main(String[] a){Scanner s=new Scanner(System.in);"
              "long x=s.nextLong(),y=s.nextLong();System.out.println(x-y);}}\n",
        "TLE": "public class Main{public static void main(String[] a){long i=0;while(true){i++;}}}\n",
        "MLE": "import java.util.*;\npublic class Main{public static void main(String[] a){List<long[]> l=new ArrayList<>();"
               "for(int i=0;i<1024;i++){l.add(new long[131072]);}System.out.println(l.size());}}\n",
        "RE": "public class Main{public static void main(String[] a){int[] x=new int[1];System.out.println(x[5]);}}\n",
        "CE": "public class Main{public static void main(String[] a){int x = \"s\";}}\n",
    },
    "javascript": {
        "AC": "const [a,b]=require('fs').readFileSync(0,'utf8').trim().split(/\\s+/).map(Number);console.log(a+b);\n",
        "WA": "const [a,b]=require('fs').readFileSync(0,'utf8').trim().split(/\\s+/).map(Number);console.log(a-b);\n",
        "TLE": "for(;;){}\n",
        "MLE": "const l=[];for(let i=0;i<1024;i++){l.push(new Array(131072).fill(i));}console.log(l.length);\n",
        "RE": "null.x();\n",
        "CE": "function f( {\n",
    },
    "go": {
        "AC": "package main\nimport \"fmt\"\nfunc main(){var a,b int64;fmt.Scan(&a,&b);fmt.Println(a+b)}\n",
        "WA": "package main\nimport \"fmt\"\nfunc main(){var a,b int64;fmt.Scan(&a,&b);fmt.Println(a-b)}\n",
        "TLE": "package main\nfunc main(){i:=0;for{i++}}\n",
        "MLE": "package main\nimport \"fmt\"\nfunc main(){b:=make([]byte,1<<30);for i:=range b{b[i]=1};fmt.Println(b[77])}\n",
        "RE": "package main\nfunc main(){var m map[string]int;m[\"a\"]=1}\n",
        "CE": "package main\nfunc main(){ x := 1 }\n",
    },
    "rust": {
        "AC": "use std::io::*;\nfn main(){let mut s=String::new();stdin().read_to_string(&mut s).unwrap();"
              "let v:Vec<i64>=s.split_whitespace().map(|x|x.parse().unwrap()).collect();println!(\"{}\",v[0]+v[1]);}\n",
        "WA": "use std::io::*;\nfn main(){let mut s=String::new();stdin().read_to_string(&mut s).unwrap();"
              "let v:Vec<i64>=s.split_whitespace().map(|x|x.parse().unwrap()).collect();println!(\"{}\",v[0]-v[1]);}\n",
        "TLE": "fn main(){let mut i:u64=1;loop{i=i.wrapping_mul(3).wrapping_add(1);if i==7{println!(\"{}\",i);}}}\n",
        "MLE": "fn main(){let v=vec![1u8;1<<30];println!(\"{}\",v[4242]);}\n",
        "RE": "fn main(){let v:Vec<i32>=Vec::new();println!(\"{}\",v[3]);}\n",
        "CE": "fn main(){ let x: i32 = \"s\"; }\n",
    },
}

SUM_TESTS = [{"input": "1 2\n", "output": "3\n"}, {"input": "40 2\n", "output": "42\n"}]
