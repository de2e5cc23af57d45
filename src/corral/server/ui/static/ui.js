// corral's dashboard: live panels over server-sent events, and the stop/delete/logout
// buttons. The panels arrive as HTML the daemon rendered with autoescaping; this file
// is the only script the page's Content-Security-Policy allows.
"use strict";

(function () {
  const csrf = document.querySelector('meta[name="csrf-token"]').content;
  const main = document.getElementById("dashboard");
  const live = document.getElementById("live");
  const actionError = document.getElementById("action-error");

  function post(url) {
    return fetch(url, {
      method: "POST",
      credentials: "same-origin",
      headers: { "X-CSRF-Token": csrf },
    });
  }

  function showError(text) {
    actionError.textContent = text;
    actionError.hidden = !text;
  }

  document.addEventListener("click", async function (event) {
    const button = event.target.closest("button[data-action]");
    if (!button) return;
    const id = button.dataset.id;
    const action = button.dataset.action;
    button.disabled = true;
    const reply = await post("/ui/sandboxes/" + encodeURIComponent(id) + "/" + action);
    if (!reply.ok) {
      let message = action + " failed (" + reply.status + ")";
      try {
        message = (await reply.json()).error.message;
      } catch (e) { /* not JSON */ }
      showError(message);
      button.disabled = false;
      return;
    }
    showError("");
    if (action === "delete") {
      const row = button.closest("tr");
      if (row) row.remove();
    }
  });

  document.getElementById("logout").addEventListener("click", async function () {
    await post("/ui/logout");
    window.location.assign("/ui/login");
  });

  const source = new EventSource(main.dataset.events);
  source.addEventListener("open", function () {
    live.textContent = "live";
    live.className = "live on";
  });
  source.addEventListener("error", function () {
    live.textContent = "reconnecting…";
    live.className = "live off";
  });
  source.addEventListener("update", function (event) {
    const changed = JSON.parse(event.data);
    for (const name of Object.keys(changed)) {
      const panel = document.getElementById("panel-" + name);
      if (panel) panel.innerHTML = changed[name];
    }
  });
  source.addEventListener("failure", function (event) {
    showError(JSON.parse(event.data).message);
    source.close();
    live.textContent = "stopped";
    live.className = "live off";
  });
})();
