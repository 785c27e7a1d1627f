// Small line charts on a canvas over the last minutes: one series or two, with axes: y from 0
// to a round number above the largest value seen in the window (ticks at 0, half and top),
// x from the window's start to now (labelled in seconds or minutes ago).

const COLORS = ["#2563eb", "#dc2626"];
const LEFT = 38, RIGHT = 6, TOP = 14, BOTTOM = 16; // room for the axes' labels

// The smallest of 1, 2, 2.5, 5 x 10^k at or above v: an axis top a person reads at a glance.
export function niceCeiling(v) {
  if (!(v > 0)) return 1;
  const power = 10 ** Math.floor(Math.log10(v));
  for (const step of [1, 2, 2.5, 5, 10]) if (step * power >= v * (1 - 1e-9)) return step * power;
  return 10 * power;
}

function label(v) {
  if (v >= 1e6) return `${+(v / 1e6).toFixed(1)}M`;
  if (v >= 1e4) return `${+(v / 1e3).toFixed(0)}k`;
  return v < 10 ? `${+v.toFixed(1)}` : `${Math.round(v)}`;
}

function ago(seconds) {
  return seconds >= 120 ? `${Math.round(seconds / 60)} min ago` : `${Math.round(seconds)} s ago`;
}

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
    const width = canvas.width, height = canvas.height;
    ctx.clearRect(0, 0, width, height);
    if (this.points.length < 2) return;
    const t0 = this.points[0][0], t1 = this.points[this.points.length - 1][0];
    const top = niceCeiling(Math.max(...this.points.flatMap(([, values]) => values.filter((v) => v != null))));
    const plotWidth = width - LEFT - RIGHT, plotHeight = height - TOP - BOTTOM;
    const x = (t) => LEFT + ((t - t0) / Math.max(1e-9, t1 - t0)) * plotWidth;
    const y = (v) => TOP + plotHeight - (v / top) * plotHeight;
    // Axes, grid lines at half and top, their labels.
    ctx.font = "10px sans-serif";
    ctx.fillStyle = "#64748b";
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (const v of [0, top / 2, top]) {
      ctx.strokeStyle = v === 0 ? "#94a3b8" : "#e2e8f0";
      ctx.lineWidth = 1;
      ctx.beginPath();
      ctx.moveTo(LEFT, Math.round(y(v)) + 0.5);
      ctx.lineTo(width - RIGHT, Math.round(y(v)) + 0.5);
      ctx.stroke();
      ctx.fillText(label(v), LEFT - 4, y(v));
    }
    ctx.strokeStyle = "#94a3b8";
    ctx.beginPath();
    ctx.moveTo(LEFT + 0.5, TOP);
    ctx.lineTo(LEFT + 0.5, TOP + plotHeight);
    ctx.stroke();
    ctx.textBaseline = "bottom";
    ctx.textAlign = "left";
    ctx.fillText(ago(t1 - t0), LEFT, height);
    ctx.textAlign = "right";
    ctx.fillText("now", width - RIGHT, height);
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
    ctx.fillStyle = "#334155";
    ctx.textAlign = "left";
    ctx.textBaseline = "top";
    const latest = this.points[this.points.length - 1][1].map((v) => (v == null ? "-" : label(v)));
    ctx.fillText(`now ${latest.join(" / ")}`, LEFT + 4, 0);
  }
}
