// Chart tick labels shared by every chart (app.js, compare.js, gpus.js, grpo.js). Chart.js picks
// "nice" tick values (steps of 1, 2 or 5 x 10^k); these helpers label them:
// - whetstoneTick(value, index, ticks): a value axis. All of an axis's labels share one format,
//   with just enough decimals that neighbours differ and the step shows ("22.25", "22.30",
//   "22.35"; not "22.3", "22.3"); tiny or huge values in exponent form ("4e-7", "1.5e-5",
//   "1.2e+6"). Called without Chart.js's tick objects it labels the lone value ("0.125").
// - whetstoneStepAxis(): the options of an x axis of training steps: whole steps only
//   (precision 0 makes Chart.js's step at least 1), labelled as integers; never "1.10".
(function () {
  "use strict";
  const MAX_DIGITS = 12;

  function exponent(v, digits) {
    if (v === 0) return "0";
    return v.toExponential(digits).replace(/\.?0+e/, "e");
  }
  function useExponent(values) {
    const big = Math.max(...values.map(Math.abs));
    return big >= 1e5 || (big > 0 && big < 1e-3);
  }
  // Decimals that show ``step`` exactly (0.05 -> 2, 0.25 -> 2, 20 -> 0).
  function decimalsOf(step) {
    for (let d = 0; d < MAX_DIGITS; d++) {
      const scaled = step * Math.pow(10, d);
      if (Math.abs(scaled - Math.round(scaled)) < 1e-6 * Math.max(1, scaled)) return d;
    }
    return MAX_DIGITS;
  }
  function distinct(labels) {
    for (let i = 1; i < labels.length; i++) if (labels[i] === labels[i - 1]) return false;
    return true;
  }

  // Labels for an axis's tick values (in axis order): one format for all of them.
  function labels(values) {
    if (useExponent(values)) {
      // enough mantissa digits to show every value exactly (1.5e+5, not 2e+5), then more
      // until neighbours differ
      const mantissa = (v) => (v === 0 ? 0 : Math.abs(v) / Math.pow(10, Math.floor(Math.log10(Math.abs(v)))));
      const first = Math.max(...values.map((v) => decimalsOf(mantissa(v))));
      for (let d = first; d <= MAX_DIGITS; d++) {
        const out = values.map((v) => exponent(v, d));
        if (distinct(out)) return out;
      }
      return values.map((v) => exponent(v, MAX_DIGITS));
    }
    let step = 0;
    for (let i = 1; i < values.length; i++) step = Math.max(step, Math.abs(values[i] - values[i - 1]));
    for (let d = step > 0 ? decimalsOf(step) : 0; d <= MAX_DIGITS; d++) {
      const out = values.map((v) => (Math.abs(v) < Math.pow(10, -d) / 2 ? 0 : v).toFixed(d));
      if (distinct(out)) return out;
    }
    return values.map(String);
  }

  function one(v) {
    if (v === 0) return "0";
    const a = Math.abs(v);
    if (a < 1e-3 || a >= 1e5) return exponent(v, 2);
    return Number(v.toPrecision(3)).toString();
  }

  window.whetstoneTick = function (v, index, ticks) {
    if (typeof v !== "number" || !Number.isFinite(v)) return String(v);
    if (!Array.isArray(ticks) || ticks.length < 2 || typeof index !== "number") return one(v);
    // Chart.js's ticks are {value, …} objects (a plain array, as from [..].map, is not an axis)
    const values = ticks.map((t) => (t && typeof t === "object" ? t.value : NaN));
    if (!values.every((x) => typeof x === "number" && Number.isFinite(x))) return one(v);
    return labels(values)[index];
  };
  const stepTick = (v) => (Number.isInteger(v) ? String(v) : "");
  window.whetstoneStepAxis = function () {
    return { type: "linear", title: { display: true, text: "step" },
             ticks: { precision: 0, callback: stepTick } };
  };
})();
