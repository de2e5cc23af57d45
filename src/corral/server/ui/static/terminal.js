// corral's dashboard: a terminal on a sandbox's page. A shell is spawned on a
// pseudo-terminal (POST .../terminal), its output read from the API's NDJSON stream,
// and the keys typed in the <pre> sent to its stdin. Text only: escape sequences are
// dropped (the shell runs with TERM=dumb). Output is set as text, never as HTML.
"use strict";

(function () {
  const button = document.getElementById("terminal-open");
  if (!button) return;
  const csrf = document.querySelector('meta[name="csrf-token"]').content;
  const screen = document.getElementById("terminal");
  const error = document.getElementById("terminal-error");
  const base = "/ui/sandboxes/" + encodeURIComponent(button.dataset.id);
  const ESCAPES = /\x1b\[[0-9;?]*[ -\/]*[@-~]|\x1b\][^\x07]*(\x07|\x1b\\)|\x1b[()][0-9A-Za-z]|\x1b[=>]|\r/g;
  const KEYS = { Enter: "\r", Backspace: "\x7f", Tab: "\t", Escape: "\x1b",
                 ArrowUp: "\x1b[A", ArrowDown: "\x1b[B", ArrowRight: "\x1b[C", ArrowLeft: "\x1b[D" };
  let input = null;  // the stdin URL once a shell runs
  let pending = "";
  let sending = false;

  function fail(text) {
    error.textContent = text;
    error.hidden = !text;
  }

  function show(text) {
    let out = screen.textContent + text.replace(ESCAPES, "");
    while (out.indexOf("\b") >= 0) out = out.replace(/[^\n]?\x08/, "");
    screen.textContent = out.slice(-200000);
    screen.scrollTop = screen.scrollHeight;
  }

  async function flush() {
    if (sending || !pending || !input) return;
    sending = true;
    const body = pending;
    pending = "";
    try {
      const reply = await fetch(input, { method: "POST", credentials: "same-origin",
        headers: { "X-CSRF-Token": csrf, "Content-Type": "application/octet-stream" }, body: body });
      if (!reply.ok) fail("could not send the keys (" + reply.status + ")");
    } finally {
      sending = false;
      if (pending) flush();
    }
  }

  async function read(url) {
    const reply = await fetch(url, { credentials: "same-origin" });
    if (!reply.ok || !reply.body) { fail("no output (" + reply.status + ")"); return; }
    const reader = reply.body.getReader();
    const decoder = new TextDecoder();
    let buffered = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffered += decoder.decode(value, { stream: true });
      let nl;
      while ((nl = buffered.indexOf("\n")) >= 0) {
        const line = buffered.slice(0, nl);
        buffered = buffered.slice(nl + 1);
        if (!line) continue;
        const event = JSON.parse(line);
        if (event.type === "stdout" || event.type === "stderr") {
          show(event.data !== undefined ? event.data : atob(event.data_b64 || ""));
        } else if (event.type === "exit") {
          show("\n[the shell exited]\n");
          input = null;
        } else if (event.type === "error") {
          fail(event.error ? event.error.message : "the terminal's stream broke off");
        }
      }
    }
  }

  screen.addEventListener("keydown", function (event) {
    if (!input) return;
    let data = KEYS[event.key];
    if (data === undefined && event.ctrlKey && event.key.length === 1) {
      const code = event.key.toUpperCase().charCodeAt(0);
      if (code >= 64 && code < 96) data = String.fromCharCode(code - 64);
    } else if (data === undefined && event.key.length === 1 && !event.metaKey) {
      data = event.key;
    }
    if (data === undefined) return;
    event.preventDefault();
    pending += data;
    flush();
  });

  button.addEventListener("click", async function () {
    button.disabled = true;
    fail("");
    const reply = await fetch(base + "/terminal", { method: "POST", credentials: "same-origin",
      headers: { "X-CSRF-Token": csrf } });
    if (!reply.ok) {
      let message = "could not open a terminal (" + reply.status + ")";
      try { message = (await reply.json()).error.message; } catch (e) { /* not JSON */ }
      fail(message);
      button.disabled = false;
      return;
    }
    const proc = await reply.json();
    const at = base + "/processes/" + encodeURIComponent(proc.id);
    input = at + "/stdin";
    screen.hidden = false;
    screen.focus();
    read(at + "/output");
  });
})();
