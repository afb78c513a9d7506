// A minimal line chart on a canvas: no library, nothing fetched from elsewhere.
const COLORS = ["#2563eb", "#d97706"];

export function drawLines(canvas, series, labels) {
  const context = canvas.getContext("2d");
  const { width, height } = canvas;
  const pad = 28;
  context.clearRect(0, 0, width, height);
  const all = series.flat();
  const top = Math.max(1e-9, ...all);
  context.strokeStyle = "#cbd5e1";
  context.strokeRect(pad, 4, width - pad - 4, height - pad);
  context.fillStyle = "#475569";
  context.font = "11px sans-serif";
  context.fillText(top.toFixed(top < 10 ? 1 : 0), 2, 14);
  context.fillText("0", 2, height - pad + 4);
  series.forEach((points, index) => {
    context.strokeStyle = COLORS[index % COLORS.length];
    context.beginPath();
    points.forEach((value, i) => {
      const x = pad + ((width - pad - 4) * i) / Math.max(1, points.length - 1);
      const y = 4 + (height - pad) * (1 - value / top);
      if (i === 0) context.moveTo(x, y);
      else context.lineTo(x, y);
    });
    context.stroke();
    context.fillStyle = COLORS[index % COLORS.length];
    context.fillText(labels[index], pad + 6 + index * 120, height - 8);
  });
}
