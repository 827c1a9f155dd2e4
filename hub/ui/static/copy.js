// The only script of the catalog: reveal "Copy" buttons and copy their text. Pages work without it.
document.addEventListener("DOMContentLoaded", function () {
  document.querySelectorAll("button[data-copy]").forEach(function (button) {
    button.hidden = false;
    button.addEventListener("click", function () {
      var done = function () { button.textContent = "Copied"; };
      if (navigator.clipboard) {
        navigator.clipboard.writeText(button.dataset.copy).then(done, function () {});
      }
    });
  });
});
