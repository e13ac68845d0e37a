// Whetstone GPU dashboard: one Chart.js line chart per figure (utilisation, memory, temperature,
// power), a line per GPU over the last hour. The data is the JSON in #gpu-series, which the
// htmx poll of #gpus replaces every few seconds; the charts stay and take the new points.
(function () {
  "use strict";
  const COLORS = ["#2f6fdf", "#d9822b", "#16a34a", "#b91c1c", "#7c3aed", "#0891b2", "#a16207", "#db2777"];
  const charts = {};

  function series() {
    const el = document.getElementById("gpu-series");
    if (!el) return null;
    try { return JSON.parse(el.textContent); } catch (e) { return null; }
  }

  function datasets(data, figure) {
    return data.gpus.map((g, i) => ({
      label: g.label, data: g[figure], borderColor: COLORS[i % COLORS.length],
      backgroundColor: COLORS[i % COLORS.length], borderWidth: 2, tension: 0.2,
      pointRadius: g[figure].length <= 2 ? 3 : 0,
    }));
  }

  function draw() {
    const data = series();
    if (!data || typeof window.Chart === "undefined") return;
    document.querySelectorAll("canvas[data-figure]").forEach((canvas) => {
      const figure = canvas.dataset.figure;
      const sets = datasets(data, figure);
      let chart = charts[figure];
      if (!chart) {
        chart = charts[figure] = new window.Chart(canvas, {
          type: "line",
          data: { datasets: sets },
          options: { animation: false, maintainAspectRatio: false, parsing: false,
            scales: {
              x: { type: "linear", min: -data.window_minutes, max: 0,
                   title: { display: true, text: "minutes ago" },
                   ticks: { callback: (v) => String(Math.abs(Math.round(v))) } },
              y: { beginAtZero: true, suggestedMax: figure === "util_pct" ? 100 : undefined,
                   title: { display: true, text: canvas.dataset.unit },
                   ticks: { callback: window.whetstoneTick } } },
            plugins: { legend: { display: data.gpus.length > 1 } } },
        });
        window.whetstoneGpuCharts = charts;  // for the browser test and the console
        return;
      }
      chart.data.datasets = sets;
      chart.options.plugins.legend.display = data.gpus.length > 1;
      chart.update("none");
    });
  }

  document.addEventListener("DOMContentLoaded", draw);
  document.addEventListener("htmx:afterSettle", draw);
})();
