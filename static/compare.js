// Whetstone compare page: the SFT runs' training and eval loss on one chart; the GRPO runs' mean
// reward (overall solid, per reward function dashed) and KL on two more (Chart.js, vendored).
(function () {
  "use strict";
  const data = document.getElementById("compare-data");
  if (!data || typeof window.Chart === "undefined") return;
  const runs = JSON.parse(data.textContent);
  const pts = (pairs) => pairs.map(([x, y]) => ({ x, y }));
  const colors = { a: "#2f6fdf", b: "#d9822b" };
  // A is drawn wider, with round points, under B's narrower line and triangles: where the two runs'
  // curves coincide (a clone with the same seed) both stay visible
  const widths = { a: 4, b: 2 }, points = { a: "circle", b: "triangle" };
  const line = (label, pairs, key, extra) => Object.assign({ label, data: pts(pairs),
    borderColor: colors[key], backgroundColor: colors[key], borderWidth: widths[key], tension: 0.2,
    pointStyle: points[key], pointRadius: (c) => (c.dataset.data.length <= 40 ? (key === "a" ? 3 : 2) : 0)
  }, extra || {});
  const chart = (id, datasets, yTitle) => {
    const canvas = document.getElementById(id);
    if (!canvas) return null;
    return new window.Chart(canvas, {
      type: "line", data: { datasets },
      options: { animation: false, maintainAspectRatio: false, parsing: false,
        scales: { x: window.whetstoneStepAxis(),
                  y: { title: { display: true, text: yTitle }, ticks: { callback: window.whetstoneTick } } } },
    });
  };
  const loss = [], reward = [], kl = [];
  for (const key of ["a", "b"]) {
    const r = runs[key], name = `${key.toUpperCase()} ${r.label}`;
    if (r.kind === "grpo") {
      reward.push(line(`${name}: mean reward`, r.curves.reward, key));
      const dashes = [[6, 4], [2, 3], [10, 3, 2, 3], [4, 4, 1, 4]];
      Object.keys(r.curves.rewards).forEach((fn, i) => reward.push(line(`${name}: ${fn}`,
        r.curves.rewards[fn], key, { borderDash: dashes[i % dashes.length], borderWidth: widths[key] - 0.5 })));
      if (r.curves.kl.length) kl.push(line(`${name}: KL`, r.curves.kl, key));
      continue;
    }
    loss.push(line(`${name}: training loss`, r.curves.loss, key));
    if (r.curves.eval_loss.length) {
      loss.push(line(`${name}: eval loss`, r.curves.eval_loss, key,
        { borderDash: [6, 4], pointRadius: 3 }));
    }
  }
  window.compareChart = chart("compare-chart", loss, "loss");
  window.compareRewardChart = chart("compare-reward-chart", reward, "mean reward");
  window.compareKlChart = chart("compare-kl-chart", kl, "KL");
})();
