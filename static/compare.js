// Whetstone compare page: both runs' training and eval loss on one chart (Chart.js, vendored).
(function () {
  "use strict";
  const data = document.getElementById("compare-data");
  const canvas = document.getElementById("compare-chart");
  if (!data || !canvas || typeof window.Chart === "undefined") return;
  const runs = JSON.parse(data.textContent);
  const pts = (pairs) => pairs.map(([x, y]) => ({ x, y }));
  const colors = { a: "#2f6fdf", b: "#d9822b" };
  const datasets = [];
  for (const key of ["a", "b"]) {
    const r = runs[key];
    datasets.push({ label: `${key.toUpperCase()} ${r.label}: training loss`, data: pts(r.curves.loss),
      borderColor: colors[key], backgroundColor: colors[key], borderWidth: 2, tension: 0.2,
      pointRadius: (c) => (c.dataset.data.length <= 40 ? 2 : 0) });
    if (r.curves.eval_loss.length) {
      datasets.push({ label: `${key.toUpperCase()} ${r.label}: eval loss`, data: pts(r.curves.eval_loss),
        borderColor: colors[key], backgroundColor: colors[key], borderDash: [6, 4], borderWidth: 2,
        tension: 0.2, pointRadius: 3 });
    }
  }
  window.compareChart = new window.Chart(canvas, {
    type: "line", data: { datasets },
    options: { animation: false, maintainAspectRatio: false, parsing: false,
      scales: { x: window.whetstoneStepAxis(),
                y: { title: { display: true, text: "loss" }, ticks: { callback: window.whetstoneTick } } } },
  });
})();
