// Whetstone run page: SSE (job events from the database) -> stats, log and a live loss chart.
(function () {
  "use strict";
  // Signed out elsewhere (another tab, an expired session) while a page's live stream or a fetch
  // runs: show the studio's own message (app/web/signed_out.py, what htmx gets for this page,
  // with its sign-in link) in #session-alert. Resolves to true when the caller is signed out.
  // Used by this run page and static/playground.js.
  async function showSignedOut() {
    const alert = document.getElementById("session-alert");
    if (alert && alert.querySelector("#signed-out")) return true;
    const r = await fetch(location.pathname + location.search, {credentials: "same-origin",
      headers: {"HX-Request": "true", "HX-Current-URL": location.href}}).catch(() => null);
    if (!r || r.status !== 401) return false;
    const box = document.createElement("div");
    box.innerHTML = await r.text();
    const msg = box.querySelector("#signed-out");
    if (!alert) return true;
    if (msg) alert.replaceChildren(msg);
    else alert.textContent = "You were signed out: sign in again in another tab, then reload.";
    return true;
  }
  window.whetstone = Object.assign(window.whetstone || {}, {showSignedOut});

  const root = document.getElementById("run");
  if (!root) return;
  const $ = (id) => document.getElementById(id);
  const FINAL = ["succeeded", "failed", "cancelled"];
  // a page rendered after the run ended already shows its final cards: the replayed "end"
  // event must not re-fetch them (that would reset an export form the user is filling in)
  const renderedFinal = FINAL.includes(($("m-state") || {}).textContent?.trim());
  // A confirmation that depends on what the run has done by now (Cancel: "nothing is trained"
  // while queued, "a checkpoint is saved at step N" once it trains) is asked of the server on
  // click (data-confirm-url); the hx-confirm text rendered with the page is the fallback.
  document.body.addEventListener("htmx:confirm", (evt) => {
    const url = evt.detail.elt.getAttribute && evt.detail.elt.getAttribute("data-confirm-url");
    if (!url || !evt.detail.question) return;
    evt.preventDefault();
    fetch(url, {credentials: "same-origin"})
      .then((r) => (r.ok ? r.text() : evt.detail.question))
      .catch(() => evt.detail.question)
      .then((question) => { if (window.confirm(question)) evt.detail.issueRequest(true); });
  });
  let chart = null;
  const points = [];
  const evalPoints = [];  // eval loss every eval_steps (metric events with eval_loss)
  let bestStep = null;    // the best evaluation's step, once training ended

  function fmt(x, digits) {
    if (x === undefined || x === null || Number.isNaN(x)) return "—";
    if (typeof x !== "number") return String(x);
    if (x !== 0 && (Math.abs(x) < 1e-3 || Math.abs(x) >= 1e5)) return x.toExponential(3);
    return Number(x.toPrecision(digits || 4)).toString();
  }
  function duration(sec) {
    if (sec === undefined || sec === null) return "—";
    sec = Math.max(0, Math.round(sec));
    // words, as app/web/render.py's duration filter: "17:15" would read as a time of day
    const h = Math.floor(sec / 3600), m = Math.floor((sec % 3600) / 60), s = sec % 60;
    const pad = (n) => String(n).padStart(2, "0");
    if (h) return `${h} h ${pad(m)} min`;
    return m ? `${m} min ${pad(s)} s` : `${s} s`;
  }
  function ensureChart() {
    if (chart || typeof window.Chart === "undefined") return chart;
    chart = new window.Chart($("loss-chart"), {
      type: "line",
      // points are drawn while there are few (a run at step 1 shows its one point)
      data: { datasets: [{ label: "training loss", data: points, borderColor: "#2f6fdf",
        backgroundColor: "rgba(47,111,223,0.1)", borderWidth: 2, tension: 0.2,
        pointRadius: (c) => (c.dataset.data.length <= 40 ? 3 : 0) },
        { label: "eval loss", data: evalPoints, borderColor: "#d9822b", backgroundColor: "#d9822b",
          borderWidth: 2, tension: 0.2,
          // the best evaluation (the checkpoint load_best_model_at_end keeps) is the big point
          pointRadius: (c) => (c.raw && c.raw.x === bestStep ? 7 : 3),
          pointStyle: (c) => (c.raw && c.raw.x === bestStep ? "star" : "circle") }] },
      options: { animation: false, maintainAspectRatio: false, parsing: false,
        // static/ticks.js comes with Chart.js (run.html loads both before this file)
        scales: { x: window.whetstoneStepAxis(),
                  y: { title: { display: true, text: "loss" }, ticks: { callback: window.whetstoneTick } } },
        plugins: { legend: { display: false } } },
    });
    return chart;
  }
  let pending = false;
  function redraw() {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => {
      pending = false;
      const c = ensureChart();
      if (!c) return;
      c.options.plugins.legend.display = evalPoints.length > 0;  // two lines: say which is which
      c.update("none");
    });
  }
  // The ETA is the current attempt's: a metric counts only after the stream's newest "running"
  // state event (a resumed run's job replays the metrics of the attempt before it, then "queued").
  let streamState = null;
  function setState(state) {
    streamState = state;
    if (state !== "running") $("m-eta").textContent = "—";
    const el = $("m-state");
    el.textContent = state;
    el.className = "state state-" + state;
    // the queue note belongs to a queued job: gone the moment the stream says it left the queue
    const place = $("place");
    if (place && state !== "queued" && place.dataset.state === "queued") {
      place.replaceChildren();
      place.dataset.state = state;
    }
  }
  const warned = new Set();
  function warn(message, details) {  // run warnings (log events of level warning) by the stats
    if (warned.has(message)) return;
    warned.add(message);
    const li = document.createElement("li");
    li.textContent = message;
    if (Array.isArray(details) && details.length) {  // e.g. every row left out: folded away
      const box = document.createElement("details"), summary = document.createElement("summary");
      summary.textContent = `show all ${details.length}`;
      const pre = document.createElement("pre");
      pre.className = "cell";
      pre.textContent = details.join("\n");
      box.append(summary, pre);
      li.append(box);
    }
    $("run-warnings").querySelector("ul").append(li);
    $("run-warnings").hidden = false;
  }
  function log(line) {
    const el = $("log");
    const atBottom = el.scrollTop + el.clientHeight >= el.scrollHeight - 4;
    el.textContent += line + "\n";
    if (atBottom) el.scrollTop = el.scrollHeight;
  }
  function stamp(ts) { return new Date(ts * 1000).toLocaleTimeString(); }

  const es = new EventSource(root.dataset.eventsUrl);
  es.onerror = async () => {
    // closed for good (not a reconnect): a signed-out browser's stream is refused (401)
    if (es.readyState !== EventSource.CLOSED || FINAL.includes($("m-state").textContent)) return;
    if (!(await showSignedOut())) log("live updates stopped: reload the page to continue");
  };
  // The training-time line is the server's figure (app/studio/train_time.py, from the logged
  // steps): read again a second after a step is logged (one read at a time, steps logged
  // meanwhile coalesced); once the run ended, the final cards bring its final value and no
  // read still under way may replace it.
  let timeTimer = null, timeDirty = false, ended = renderedFinal;
  function refreshTrainingTime() {
    if (ended) return;
    if (timeTimer) { timeDirty = true; return; }
    timeTimer = setTimeout(async () => {
      timeDirty = false;
      const r = await fetch(root.dataset.trainingTimeUrl, {credentials: "same-origin"})
        .catch(() => null);
      const html = r && r.ok ? await r.text() : null;
      timeTimer = null;
      if (ended) return;
      const box = document.createElement("div");
      box.innerHTML = html || "";
      const fresh = box.querySelector("#training-time-box"), old = $("training-time-box");
      if (fresh && old) { old.replaceWith(fresh); stampTicks(); }
      if (timeDirty) refreshTrainingTime();
    }, 1000);
  }
  // Between two steps (GRPO's take 5-15 s) the line counts on by itself: each figure the server
  // rendered as "so far" (data-tick, seconds) runs on from the moment it arrived; a step's
  // refresh (above) brings the server's figure again, the run's end stops the clock.
  const tickedSince = new WeakMap();
  function stampTicks() {  // the moment each figure arrived (page load, or a refresh's swap)
    for (const el of document.querySelectorAll("#training-time-box [data-tick]")) {
      if (!tickedSince.has(el)) tickedSince.set(el, performance.now());
    }
  }
  stampTicks();
  setInterval(() => {
    if (ended) return;
    stampTicks();
    for (const el of document.querySelectorAll("#training-time-box [data-tick]")) {
      const base = Number(el.dataset.tick);
      if (Number.isFinite(base)) el.textContent = duration(base + (performance.now() - tickedSince.get(el)) / 1000);
    }
  }, 500);
  es.addEventListener("metric", (e) => {
    const d = JSON.parse(e.data);
    refreshTrainingTime();
    $("m-step").textContent = d.total_steps ? `${d.step} / ${d.total_steps}` : String(d.step);
    if (d.loss !== undefined) $("m-loss").textContent = fmt(d.loss);
    if (d.learning_rate !== undefined) $("m-lr").textContent = fmt(d.learning_rate);
    if (d.grad_norm !== undefined) $("m-grad").textContent = fmt(d.grad_norm);
    if (d.tokens_per_second !== undefined && $("m-tps")) $("m-tps").textContent = fmt(d.tokens_per_second);
    if (d.eta_seconds !== undefined && streamState === "running") {
      $("m-eta").textContent = duration(d.eta_seconds);
    }
    if (d.memory_gib !== undefined) $("m-mem").textContent = `${fmt(d.memory_gib)} GiB ${d.memory_kind || ""}`;
    if (d.total_steps) $("m-progress").style.width = Math.min(100, (100 * d.step) / d.total_steps) + "%";
    if (d.loss !== undefined && d.loss !== null) { points.push({ x: d.step, y: d.loss }); redraw(); }
    if (d.eval_loss !== undefined && d.eval_loss !== null) { evalPoints.push({ x: d.step, y: d.eval_loss }); redraw(); }
    if (d.best_step !== undefined && d.best_step !== null) { bestStep = d.best_step; redraw(); }
  });
  es.addEventListener("state", (e) => {
    const d = JSON.parse(e.data);
    setState(d.state);
    log(`[${stamp(d.ts)}] state: ${d.state}${d.reason ? " — " + d.reason : ""}`);
    if (d.error) { const el = $("m-error"); el.hidden = false; el.textContent = d.error; log("error: " + d.error); }
    if (d.state === "succeeded") $("m-progress").style.width = "100%";
  });
  es.addEventListener("log", (e) => {
    const d = JSON.parse(e.data);
    log(`[${stamp(d.ts)}] ${d.level && d.level !== "info" ? d.level + ": " : ""}${d.message}`);
    if (d.level === "warning" || d.level === "warn") warn(d.message, d.details);
  });
  es.addEventListener("progress", (e) => {
    const d = JSON.parse(e.data);
    log(`[${stamp(d.ts)}] ${d.stage}: ${d.done}/${d.total}${d.message ? " " + d.message : ""}`);
  });
  // The run ended while watched: the header and every server-rendered card (controls, links,
  // memory, evaluation, artifacts, exports) are re-rendered from ONE fetch of the page. (Separate
  // htmx.ajax calls share the body's request queue, which keeps only the last waiting request:
  // the Cancel button and the evaluation card used to stay stale.)
  const FINAL_PARTS = ["controls", "run-links", "training-time-box", "run-memory", "evaluation",
    "artifacts", "exports"];
  async function refreshFinalParts() {
    const resp = await fetch(window.location.pathname, { headers: { Accept: "text/html" } });
    if (!resp.ok) return;
    const doc = new DOMParser().parseFromString(await resp.text(), "text/html");
    for (const id of FINAL_PARTS) {
      const old = $(id), fresh = doc.getElementById(id);
      if (!old || !fresh) continue;
      old.replaceWith(fresh);
      if (window.htmx) window.htmx.process(fresh);
    }
  }
  // A cancelled or failed run can be resumed from another tab, the API or a teammate's script:
  // its run then has a new job, which this page (whose stream ended with the old one) would
  // never show. While the page is visible it asks the run's current job every few seconds and
  // reloads when that job is not the one it shows.
  const RESUMABLE = ["failed", "cancelled"], FOLLOW_MS = 5000;
  let following = null;
  function followResumes(state) {
    if (following || !RESUMABLE.includes(state) || !root.dataset.jobUrl) return;
    following = setInterval(async () => {
      if (document.hidden) return;
      const r = await fetch(root.dataset.jobUrl, {credentials: "same-origin"}).catch(() => null);
      if (!r || !r.ok) return;
      const run = await r.json().catch(() => null);
      if (run && run.job_id !== null && String(run.job_id) !== root.dataset.jobId) {
        clearInterval(following);
        window.location.reload();
      }
    }, FOLLOW_MS);
  }
  if (renderedFinal) followResumes(($("m-state") || {}).textContent.trim());
  es.addEventListener("end", (e) => {
    es.close();
    ended = true;
    clearTimeout(timeTimer);
    const d = JSON.parse(e.data);
    if (FINAL.includes(d.state)) setState(d.state);
    if (!renderedFinal) refreshFinalParts();
    followResumes(d.state);
  });
})();
