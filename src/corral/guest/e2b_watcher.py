"""The filesystem watcher behind E2B's ``watch_dir``: runs *inside* a sandbox as
``python3 -u -c <this file> ROOT RECURSIVE MAX_DIRS WITH_ENTRY`` (started by
:mod:`corral.server.compat.e2b_watch`), watches ROOT with inotify and writes one JSON
event per line on stdout. Standard library only.
"""

if __name__ == "__main__":  # module level in the sandbox, nothing when imported
    import ctypes
    import json
    import os
    import struct
    import sys

    libc = ctypes.CDLL(None, use_errno=True)
    root, recursive, max_dirs = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
    with_entry = sys.argv[4] == "1"
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    CREATE, MODIFY, ATTRIB, MOVED_FROM, MOVED_TO = 0x100, 0x2, 0x4, 0x40, 0x80
    DELETE, DELETE_SELF, MOVE_SELF, ISDIR, IGNORED = 0x200, 0x400, 0x800, 0x40000000, 0x8000
    MASK = CREATE | MODIFY | ATTRIB | MOVED_FROM | MOVED_TO | DELETE | DELETE_SELF | MOVE_SELF
    out = os.fdopen(1, "w", buffering=1)
    def send(m):
        out.write(json.dumps(m) + "\n")
    def fail(why):
        send({"error": why})
        sys.exit(1)
    if not os.path.exists(root):
        fail("not_found")
    if not os.path.isdir(root):
        fail("not_a_directory")
    fd = libc.inotify_init1(os.O_CLOEXEC)
    if fd < 0:
        fail(os.strerror(ctypes.get_errno()))
    wds = {}
    def add(path, rel):
        if len(wds) >= max_dirs:
            return 0
        wd = libc.inotify_add_watch(fd, os.fsencode(path), MASK)
        if wd < 0:
            return ctypes.get_errno()
        wds[wd] = rel
        return 0
    err = add(root, "")
    if err:
        fail(os.strerror(err))
    if recursive:
        for dirpath, dirs, _ in os.walk(root):
            for d in dirs:
                p = os.path.join(dirpath, d)
                add(p, os.path.relpath(p, root))
    def add_new(rel):
        # A directory that appeared: watch it, then report what is already in it (made
        # before its watch was added: inotify would never tell), its subdirectories too.
        add(os.path.join(root, rel), rel)
        for dirpath, dirs, files in os.walk(os.path.join(root, rel)):
            if len(wds) >= max_dirs:  # bounded like the watches themselves
                break
            for name in dirs + files:
                p = os.path.join(dirpath, name)
                send(event(os.path.relpath(p, root), "create"))
            for d in dirs:
                p = os.path.join(dirpath, d)
                add(p, os.path.relpath(p, root))
    top = os.path.abspath(root)
    def event(rel, kind):
        m = {"name": rel, "type": kind}
        if with_entry:
            p = os.path.join(top, rel)
            try:
                s = os.lstat(p)  # never followed: a link is described as itself
                entry = {"path": p, "size": s.st_size, "mode": s.st_mode, "mtime": s.st_mtime}
                if s.st_mode & 0o170000 == 0o120000:
                    entry["target"] = os.readlink(p)  # swapped for a non-link meanwhile: none
                m["entry"] = entry
            except (OSError, ValueError):
                pass  # gone already (removed, renamed away): no entry, as envd
        return m
    send({"ready": True})
    while True:
        data = os.read(fd, 65536)
        i = 0
        while i + 16 <= len(data):
            wd, mask, _cookie, n = struct.unpack_from("iIII", data, i)
            name = data[i + 16:i + 16 + n].rstrip(b"\0").decode("utf-8", "replace")
            i += 16 + n
            if mask & IGNORED:
                wds.pop(wd, None)
                continue
            base = wds.get(wd)
            if base is None or (not name and base):  # a subdirectory's own: its parent's says
                continue
            rel = os.path.join(base, name) if name else base
            if mask & (CREATE | MOVED_TO):
                kind = "create"
            elif mask & MODIFY:
                kind = "write"
            elif mask & (DELETE | DELETE_SELF):
                kind = "remove"
            elif mask & (MOVED_FROM | MOVE_SELF):
                kind = "rename"
            elif mask & ATTRIB:
                kind = "chmod"
            else:
                continue
            send(event(rel, kind))
            if recursive and mask & ISDIR and mask & (CREATE | MOVED_TO):
                add_new(rel)
