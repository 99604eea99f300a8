var plotlyQueue = [];
function whenPlotly(f) { if (window.Plotly) { f(); } else { plotlyQueue.push(f); } }
document.addEventListener("DOMContentLoaded", function () {
  var src = document.getElementById("plotly-gz");
  if (!src) return;
  var bytes = Uint8Array.from(atob(src.textContent), function (c) { return c.charCodeAt(0); });
  var text = new Response(new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"))).text();
  text.then(function (js) {
    var s = document.createElement("script");
    s.textContent = js;
    document.head.appendChild(s);
    plotlyQueue.splice(0).forEach(function (f) { f(); });
  });
});
