document.querySelectorAll("table.sortable th").forEach(function (th, col) {
  th.addEventListener("click", function () {
    var table = th.closest("table"), body = table.tBodies[0], rows = Array.from(body.rows);
    var index = Array.prototype.indexOf.call(th.parentNode.children, th);
    var asc = !th.classList.contains("asc");
    th.parentNode.querySelectorAll("th").forEach(function (h) { h.classList.remove("asc", "desc"); });
    th.classList.add(asc ? "asc" : "desc");
    function key(row) {
      var cell = row.cells[index], v = cell.getAttribute("data-v");
      return v === null ? cell.textContent : parseFloat(v);
    }
    rows.sort(function (a, b) {
      var x = key(a), y = key(b);
      var c = (typeof x === "number" && typeof y === "number") ? x - y : String(x).localeCompare(String(y));
      return asc ? c : -c;
    });
    rows.forEach(function (r) { body.appendChild(r); });
  });
});
