// Upload progress on the dataset upload forms: htmx reports the request body's progress
// (htmx:xhr:progress); show it in the form's <progress data-upload-progress> element.
(function () {
  function mib(n) { return (n / 1048576).toFixed(1) + " MiB"; }
  document.addEventListener("htmx:xhr:progress", (e) => {
    const form = e.target.closest && e.target.closest("form");
    const bar = form && form.querySelector("[data-upload-progress]");
    if (!bar || !e.detail.lengthComputable) return;
    bar.hidden = false;
    bar.max = e.detail.total;
    bar.value = e.detail.loaded;
    const label = form.querySelector("[data-upload-progress-text]");
    if (label) {
      label.textContent = e.detail.loaded < e.detail.total
        ? "uploading " + mib(e.detail.loaded) + " of " + mib(e.detail.total)
        : "uploaded; starting validation…";
    }
  });
})();
