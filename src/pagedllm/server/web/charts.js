// Small line charts on a canvas over the last minutes: one series or two, y from 0 to the
// largest value seen in the window.

const COLORS = ["#2563eb", "#dc2626"];

export class Chart {
  constructor(canvas, seconds = 300) {
    this.canvas = canvas;
    this.seconds = seconds;
    this.points = []; // [time, [values...]]
  }

  add(time, values) {
    this.points.push([time, values]);
    while (this.points.length && this.points[0][0] < time - this.seconds) this.points.shift();
    this.draw();
  }

  draw() {
    const { canvas } = this;
    const ctx = canvas.getContext("2d");
    const width = canvas.width, height = canvas.height, pad = 4;
    ctx.clearRect(0, 0, width, height);
    if (this.points.length < 2) return;
    const t0 = this.points[0][0], t1 = this.points[this.points.length - 1][0];
    const max = Math.max(1e-9, ...this.points.flatMap(([, values]) => values.filter((v) => v != null)));
    const x = (t) => pad + ((t - t0) / Math.max(1e-9, t1 - t0)) * (width - 2 * pad);
    const y = (v) => height - pad - (v / max) * (height - 2 * pad - 12);
    const series = this.points[0][1].length;
    for (let s = 0; s < series; s++) {
      ctx.strokeStyle = COLORS[s % COLORS.length];
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      let started = false;
      for (const [t, values] of this.points) {
        if (values[s] == null) continue;
        if (started) ctx.lineTo(x(t), y(values[s]));
        else ctx.moveTo(x(t), y(values[s]));
        started = true;
      }
      ctx.stroke();
    }
    ctx.fillStyle = "#555";
    ctx.font = "11px sans-serif";
    const latest = this.points[this.points.length - 1][1].map((v) => (v == null ? "-" : v.toFixed(v < 10 ? 1 : 0)));
    ctx.fillText(`max ${max.toFixed(max < 10 ? 1 : 0)}   now ${latest.join(" / ")}`, pad, 11);
  }
}
