// Playground: send the same prompt to every pane (each keeps its own history), stream the
// answers from the session's events (SSE: session, token, answer, state, end).
(function () {
  const root = document.getElementById("playground");
  if (!root) return;
  const model = root.dataset.model;
  const sides = root.dataset.sides.split(",");
  const form = document.getElementById("pg-form");
  const statusEl = document.getElementById("pg-status");
  const errorEl = document.getElementById("pg-error");
  const sendBtn = document.getElementById("pg-send");
  const stopBtn = document.getElementById("pg-stop");
  const csrf = (document.querySelector('meta[name="csrf-token"]') || {}).content || "";
  const history = Object.fromEntries(sides.map((s) => [s, []]));
  let session = null, source = null, lastId = 0, pending = null, ended = null, waiting = false;

  function bubble(side, role, text) {
    const el = document.createElement("div");
    el.className = "pg-msg " + role;
    el.textContent = text;
    document.getElementById("pg-log-" + side).appendChild(el);
    return el;
  }
  function showError(msg) { errorEl.textContent = msg || ""; errorEl.hidden = !msg; }
  // Signed out (in another tab, or the session ended): the studio's own "you were signed out"
  // message (app/web/signed_out.py, what htmx gets for this page) in #session-alert, and the
  // reply in flight ends instead of waiting for a stream that is gone.
  class SignedOut extends Error {}
  async function signedOut() {
    if (source) { source.close(); source = null; }
    session = null;
    const alert = document.getElementById("session-alert");
    if (!(await window.whetstone.showSignedOut()) && alert && !alert.textContent) {
      alert.textContent = "You were signed out: sign in again in another tab, then retry here.";
    }
    statusEl.textContent = "Signed out: sign in again, then send the prompt again.";
    finish(" (not answered: you were signed out)");
  }
  async function api(url, body) {
    const r = await fetch(url, {method: "POST", credentials: "same-origin",
      headers: {"Content-Type": "application/json", "X-CSRF-Token": csrf},
      body: JSON.stringify(body)});
    if (r.status === 401) { await signedOut(); throw new SignedOut(); }
    const data = await r.json().catch(() => ({}));
    if (!r.ok) {
      const e = data.error || {};
      throw new Error((e.param ? e.param + ": " : "") + (e.message || r.statusText));
    }
    return data;
  }
  function finish(msg) {
    if (pending) {
      for (const s of sides) {
        const p = pending.out[s];
        if (p && p.classList.contains("pending")) { p.classList.remove("pending"); if (msg) { p.classList.add("error"); p.textContent += msg; } }
      }
    }
    pending = null;
    sendBtn.disabled = false;
    stopBtn.hidden = true;
  }
  // Stop: the worker ends each side with its text so far (finish_reason "stopped")
  async function stop() {
    if (!pending) return;
    pending.stop = true;
    stopBtn.disabled = true;
    if (waiting && session) {  // no model loaded yet: leave the queue (the whole session ends)
      const id = session;
      if (source) source.close();
      source = null; session = null; waiting = false;
      for (const s of sides) history[s].pop();  // the prompt was never answered
      finish(" (stopped before the model loaded)");
      statusEl.textContent = "Stopped: the session left the queue; the next prompt queues again.";
      try { await api(`/api/playground/sessions/${id}/stop`, {}); }
      catch (e) { if (!(e instanceof SignedOut)) showError(e.message); }
      return;
    }
    if (!pending.id) return;  // sent as soon as the prompt's POST answers
    try { await api(`/api/playground/sessions/${session}/prompts/${pending.id}/stop`, {}); }
    catch (e) { if (!(e instanceof SignedOut)) showError(e.message); }
  }
  stopBtn.addEventListener("click", stop);
  // While the session waits for a slot: its place in the queue (position, why it waits, the
  // estimated start: the Queue page's words, the "queue" of GET /api/playground/sessions/{id}),
  // asked again every 5 s (the run page's pace) until it loads, ends or is left.
  let waitTimer = null;
  function showWait(s) {
    const q = s && s.queue;
    statusEl.textContent = "Waiting for a free slot" + (q && q.text ? ": " + q.text : "…");
  }
  function followWait() {
    clearTimeout(waitTimer);
    const id = session;
    waitTimer = setTimeout(async () => {
      if (!waiting || session !== id) return;
      const r = await fetch(`/api/playground/sessions/${id}`, {credentials: "same-origin"})
        .catch(() => null);
      const s = r && r.ok ? await r.json().catch(() => null) : null;
      if (!waiting || session !== id) return;
      if (s && s.status === "queued") showWait(s);
      followWait();
    }, 5000);
  }
  function listen() {
    if (source) source.close();
    source = new EventSource(`/api/playground/sessions/${session}/events?after=${lastId}`);
    const data = (ev) => { lastId = Math.max(lastId, Number(ev.lastEventId) || 0); return JSON.parse(ev.data); };
    source.addEventListener("session", (ev) => {
      const d = data(ev);
      if (d.status === "ended") {  // it gave its slot up to a queued job (worker/jobs/playground.py)
        ended = d.message;
        statusEl.textContent = d.message;
        if (!pending) for (const s of sides) bubble(s, "note", d.message);
        return;
      }
      waiting = false;
      statusEl.textContent = `Loaded on ${d.device} in ${d.load_seconds}s (load ${d.loads}); answering…`;
    });
    source.onerror = async () => {
      // the stream ended: a signed-out browser's reconnect is refused (401), which closes it
      if (source && source.readyState !== EventSource.CLOSED) return;
      const r = await fetch(`/api/playground/sessions/${session}`, {credentials: "same-origin"})
        .catch(() => null);
      if (r && r.status === 401) signedOut();
      else if (pending) finish(" (the connection to the studio was lost)");
    };
    source.addEventListener("token", (ev) => handle("token", data(ev)));
    source.addEventListener("answer", (ev) => handle("answer", data(ev)));
    for (const name of ["prompt", "log", "progress"]) source.addEventListener(name, data);
    source.addEventListener("state", (ev) => {
      const d = data(ev);
      if (d.state === "failed") showError("The session failed: " + (d.error || d.reason || "see the queue page"));
      else if (d.state === "queued" && d.reason) { waiting = true; statusEl.textContent = "Waiting in the queue again: " + d.reason; followWait(); }
      else if (d.state === "running") waiting = false;
    });
    source.addEventListener("end", () => {
      source.close(); source = null; session = null;
      if (pending && pending.id) { const again = pending.body; pending.retry ? finish(" (the session ended before answering)") : send(again, true); }
      else if (!pending && !ended) statusEl.textContent = "The session ended (idle); the next prompt loads the model again.";
      ended = null;
    });
  }
  function handle(type, d) {
    if (!pending) return;
    if (!pending.id) { pending.early.push([type, d]); return; }  // before the POST answered
    if (d.request_id !== pending.id || !pending.out[d.side]) return;
    if (type === "token") { pending.out[d.side].textContent += d.text; return; }
    {
      const el = pending.out[d.side];
      el.classList.remove("pending");
      if (d.error) { el.classList.add("error"); el.textContent = d.error; history[d.side].pop(); }
      else {
        el.textContent = d.text;
        if (d.finish_reason === "stopped") {
          el.classList.add("stopped");
          const mark = document.createElement("span");
          mark.className = "pg-stopped";
          mark.textContent = " (stopped)";
          el.appendChild(mark);
        }
        history[d.side].push({role: "assistant", content: d.text});
        const u = d.usage || {};
        document.getElementById("pg-stats-" + d.side).textContent =
          `${u.completion_tokens} tokens (${d.finish_reason}) · first token ${d.first_token_seconds}s · ${d.tokens_per_second} tokens/s`;
      }
      pending.left.delete(d.side);
      if (pending.left.size === 0) { statusEl.textContent = "Ready: the model stays loaded for the next prompt."; finish(); }
    }
  }
  async function send(body, retry) {
    const mine = pending;  // Stop while queued ends this reply: then nothing below applies
    try {
      const s = await api("/api/playground/sessions", {model, ...Object.fromEntries(
        SAMPLING.map((name) => [name, body[name]]))});
      if (pending !== mine) return;
      if (s.id !== session) { session = s.id; lastId = 0; listen(); }
      waiting = s.status === "queued";
      if (waiting) { showWait(s); followWait(); }
      else statusEl.textContent = s.status === "ready" ? "Answering…" : "Loading the model…";
      const r = await api(`/api/playground/sessions/${session}/prompts`, body);
      if (pending !== mine) return;
      pending.id = r.request_id; pending.body = body; pending.retry = !!retry;
      form.dataset.requestId = r.request_id;  // the prompt a page left now can stop (tests wait on it)
      if (pending.stop) stop();
      for (const [type, d] of pending.early.splice(0)) handle(type, d);
    } catch (e) {
      if (pending !== mine) return;
      for (const s of sides) history[s].pop();
      if (e instanceof SignedOut) return;  // signedOut() said so and ended the reply
      showError(e.message);
      finish(" (not sent)");
    }
  }
  // The sampling fields as numbers, or null after naming the first field that is not one (an
  // empty field, or text a number input cannot read, would otherwise go out as null and the
  // server would use its default unseen). Ranges are the server's to check: it names the field.
  const SAMPLING = ["temperature", "top_p", "max_tokens", "top_k", "min_p", "repetition_penalty"];
  function numbers() {
    const out = {};
    for (const name of SAMPLING) form.elements[name].removeAttribute("aria-invalid");
    for (const name of SAMPLING) {
      const el = form.elements[name];
      const raw = String(el.value).trim();
      const value = Number(raw);
      if ((el.validity && el.validity.badInput) || raw === "" || !Number.isFinite(value)) {
        el.setAttribute("aria-invalid", "true");
        el.focus();
        showError(`${name}: must be a number${raw ? `, not ${JSON.stringify(raw)}` : ""}`);
        return null;
      }
      out[name] = value;
    }
    return out;
  }
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    if (pending) return;
    const f = new FormData(form);
    const text = String(f.get("prompt") || "").trim();
    if (!text) return;
    const sampling = numbers();
    if (!sampling) return;  // numbers() said which field, nothing is sent
    showError("");
    const out = {};
    for (const s of sides) {
      history[s].push({role: "user", content: text});
      bubble(s, "user", text);
      out[s] = bubble(s, "assistant pending", "");
    }
    pending = {id: null, out, left: new Set(sides), early: []};
    sendBtn.disabled = true;
    stopBtn.hidden = false; stopBtn.disabled = false;
    form.elements.prompt.value = "";
    send({messages_by_side: Object.fromEntries(sides.map((s) => [s, history[s].slice()])),
          system: String(f.get("system") || ""), ...sampling}, false);
  });
  // Leaving the page (the tab closed, another page opened) before the answer ended: nobody
  // will read it. The studio stops it, and a session still waiting in the queue leaves it, so
  // it neither loads the model nor holds a slot for nobody; a keepalive request outlives the
  // page. (The prompt's id is known once its POST has answered.)
  window.addEventListener("pagehide", () => {
    if (!pending || !pending.id || !session) return;
    fetch(`/api/playground/sessions/${session}/prompts/${encodeURIComponent(pending.id)}/leave`,
      {method: "POST", keepalive: true, credentials: "same-origin", headers: {"X-CSRF-Token": csrf}})
      .catch(() => {});
  });
  document.getElementById("pg-clear").addEventListener("click", () => {
    if (pending) return;
    for (const s of sides) { history[s].length = 0; document.getElementById("pg-log-" + s).textContent = ""; document.getElementById("pg-stats-" + s).textContent = ""; }
  });
})();
