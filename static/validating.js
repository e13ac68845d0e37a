// Dataset page while its upload is validated in the background: follow the validate job's
// events over SSE ("validating n / N rows") and show the report once the job has ended.
(function () {
  const root = document.getElementById("validating");
  if (!root || !window.EventSource) return;
  const bar = document.getElementById("validating-bar");
  const text = document.getElementById("validating-text");
  const es = new EventSource(root.dataset.eventsUrl);
  es.addEventListener("progress", (e) => {
    const d = JSON.parse(e.data);
    if (d.total) { bar.max = d.total; } else { bar.removeAttribute("max"); }
    bar.value = d.done || 0;
    text.textContent = d.message || ("validating " + d.done + " rows");
  });
  es.addEventListener("end", () => { es.close(); window.location.reload(); });
})();
