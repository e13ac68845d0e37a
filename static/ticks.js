// Compact chart tick labels shared by the run-page charts (app.js, grpo.js): Chart.js's own
// labels for small values read "4.00000000E-7"; these read "4e-7", "0.125", "1.2e+6".
window.whetstoneTick = function (v) {
  if (typeof v !== "number" || !Number.isFinite(v)) return String(v);
  if (v === 0) return "0";
  const a = Math.abs(v);
  if (a < 1e-3 || a >= 1e5) return v.toExponential(2).replace(/\.?0+e/, "e");
  return Number(v.toPrecision(3)).toString();
};
