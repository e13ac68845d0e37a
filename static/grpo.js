// Whetstone GRPO run page: reward per function + overall, std, KL, completion length and the
// zero-variance fraction from metric events; the recent-samples table from sample events.
// It opens its own EventSource on the same job stream as app.js (events come from the database).
(function () {
  "use strict";
  const root = document.getElementById("run");
  const box = document.getElementById("grpo");
  if (!root || !box) return;
  const $ = (id) => document.getElementById(id);
  const COLORS = ["#2f6fdf", "#d9480f", "#2b8a3e", "#862e9c", "#e67700", "#0b7285", "#c2255c"];
  const series = {};  // name -> [{x, y}]
  const aux = { kl: [], completion_length: [], frac_zero_std_groups: [] };
  let rewardChart = null, auxChart = null, pending = false;
  // axes as every chart labels them (static/ticks.js, loaded by run.html before this file)
  const tick = window.whetstoneTick, stepAxis = window.whetstoneStepAxis;

  function fmt(x) {
    if (x === undefined || x === null || Number.isNaN(x)) return "—";
    if (x !== 0 && (Math.abs(x) < 1e-3 || Math.abs(x) >= 1e5)) return x.toExponential(3);
    return Number(x.toPrecision(4)).toString();
  }
  function line(label, data, i, axis) {
    return { label, data, borderColor: COLORS[i % COLORS.length], pointRadius: 0, borderWidth: 2,
      tension: 0.2, yAxisID: axis || "y" };
  }
  function charts() {
    if (typeof window.Chart === "undefined") return false;
    if (!rewardChart) {
      rewardChart = new window.Chart($("reward-chart"), { type: "line", data: { datasets: [] },
        options: { animation: false, maintainAspectRatio: false, parsing: false,
          scales: { x: stepAxis(),
                    y: { title: { display: true, text: "mean reward" }, ticks: { callback: tick } } } } });
      auxChart = new window.Chart($("grpo-aux-chart"), { type: "line",
        data: { datasets: [line("KL", aux.kl, 0), line("completion length", aux.completion_length, 1, "y2"),
                           line("zero-variance groups", aux.frac_zero_std_groups, 2)] },
        options: { animation: false, maintainAspectRatio: false, parsing: false,
          scales: { x: stepAxis(),
                    y: { title: { display: true, text: "KL / fraction" }, ticks: { callback: tick } },
                    y2: { position: "right", title: { display: true, text: "tokens" },
                          grid: { drawOnChartArea: false }, ticks: { callback: tick } } } } });
    }
    return true;
  }
  function redraw() {
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => {
      pending = false;
      if (!charts()) return;
      const names = Object.keys(series);
      if (rewardChart.data.datasets.length !== names.length) {
        rewardChart.data.datasets = names.map((n, i) => line(n, series[n], i));
      }
      rewardChart.update("none");
      auxChart.update("none");
    });
  }
  const HEADS = Array.from(document.querySelectorAll("#grpo-samples thead th"), (th) => th.textContent);
  function cell(text, cls) {
    const td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    return td;
  }
  function row(cells) {  // each cell labelled with its column (phones show the rows stacked)
    const tr = document.createElement("tr");
    cells.forEach((td, i) => { if (HEADS[i]) td.dataset.label = HEADS[i]; });
    tr.append(...cells);
    return tr;
  }

  const es = new EventSource(root.dataset.eventsUrl);
  es.addEventListener("metric", (e) => {
    const d = JSON.parse(e.data);
    if (d.reward === undefined) return;
    $("g-reward").textContent = fmt(d.reward);
    $("g-std").textContent = fmt(d.reward_std);
    $("g-kl").textContent = fmt(d.kl);
    $("g-len").textContent = fmt(d.completion_length);
    $("g-zero").textContent = d.frac_zero_std_groups === undefined ? "—"
      : Math.round(100 * d.frac_zero_std_groups) + "%";
    (series["overall"] = series["overall"] || []).push({ x: d.step, y: d.reward });
    for (const [k, v] of Object.entries(d)) {
      if (k.startsWith("reward/") && typeof v === "number") {
        const name = k.slice(7);
        (series[name] = series[name] || []).push({ x: d.step, y: v });
      }
    }
    for (const k of Object.keys(aux)) {
      if (typeof d[k] === "number") aux[k].push({ x: d.step, y: d[k] });
    }
    redraw();
  });
  es.addEventListener("sample", (e) => {
    const d = JSON.parse(e.data);
    const body = document.querySelector("#grpo-samples tbody");
    body.textContent = "";
    for (const r of d.rows || []) {
      const rewards = Object.entries(r.rewards || {}).map(([k, v]) => `${k}: ${fmt(v)}`).join("\n");
      body.append(row([cell(d.step), cell(r.group), cell(r.prompt, "text"), cell(r.completion, "text"),
                       cell(rewards, "text"), cell(fmt(r.reward)), cell(fmt(r.advantage))]));
    }
  });
  es.addEventListener("end", () => es.close());
})();
