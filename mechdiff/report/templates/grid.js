function gridText(D) {
  function name(l, h) { return "L" + l + "H" + h; }
  function num(v) { return v === null ? "-" : Number(v).toPrecision(3); }
  var inC = {};
  Object.keys(D.members).forEach(function (c) {
    D.members[c].forEach(function (p) { var k = p.join(","); (inC[k] = inC[k] || []).push(c); });
  });
  function classes(c, l, h) {
    return D.members[c].filter(function (p) { return p[0] === l && p[1] === h; })
      .map(function (p) { return D.classes[p[2]]; });
  }
  var out = [];
  D.views.forEach(function (v) {
    var text = [];
    for (var h = 0; h < D.heads; h++) {
      var row = [];
      for (var l = 0; l < D.layers; l++) {
        var lines;
        if (v.a !== undefined) {
          var a = classes(v.a, l, h), b = classes(v.b, l, h);
          lines = ["<b>" + name(l, h) + "</b>: " + v.name, v.a + ": " + (a.join(", ") || "-"),
                   v.b + ": " + (b.join(", ") || "-"),
                   "shared: " + (a.filter(function (x) { return b.indexOf(x) >= 0; }).join(", ") || "-")];
        } else {
          lines = ["<b>" + name(l, h) + "</b> in " + v.name];
          var seen = {};
          v.pairs.forEach(function (p) {
            if (p[0] !== l || p[1] !== h) return;
            var parts = [], k = p.slice(0, 3).join(",");
            seen[p[2]] = 1;
            if (p[3] != null) parts.push("attribution " + num(p[3]) + " (rank " + p[4] + ")");
            if (p[5] != null) parts.push("selected " + num(p[5]));
            if (p[6] != null) parts.push("path patching " + num(p[6]));
            parts.push("in " + ((inC[k] || []).join(", ") || "no circuit"));
            lines.push(D.classes[p[2]] + ": " + parts.join("; "));
          });
          Object.keys(D.members).forEach(function (c) {
            D.members[c].forEach(function (p) {
              if (p[0] === l && p[1] === h && !seen[p[2]]) {
                seen[p[2]] = 1;
                lines.push(D.classes[p[2]] + ": in " + inC[p.join(",")].join(", "));
              }
            });
          });
          (v.notes[name(l, h)] || []).forEach(function (n) { lines.push(D.notes[n]); });
          if (lines.length === 1) lines.push("no score in this run");
        }
        row.push(lines.join("<br>"));
      }
      text.push(row);
    }
    out.push(text);
  });
  return out;
}
