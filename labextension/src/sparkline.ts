/** A tiny SVG loss curve: training loss (and validation loss when there is one) per epoch. */
const NS = 'http://www.w3.org/2000/svg';

export class Sparkline {
  readonly node: SVGSVGElement;
  private train: SVGPathElement;
  private val: SVGPathElement;

  constructor(
    private width = 180,
    private height = 36
  ) {
    this.node = document.createElementNS(NS, 'svg');
    this.node.setAttribute('class', 'aibro-sparkline');
    this.node.setAttribute('width', String(width));
    this.node.setAttribute('height', String(height));
    this.node.setAttribute('viewBox', `0 0 ${width} ${height}`);
    this.node.setAttribute('preserveAspectRatio', 'none');
    this.train = this.path('aibro-sparkline-loss');
    this.val = this.path('aibro-sparkline-val');
  }

  private path(cls: string): SVGPathElement {
    const p = document.createElementNS(NS, 'path');
    p.setAttribute('class', cls);
    p.setAttribute('fill', 'none');
    this.node.appendChild(p);
    return p;
  }

  /** One point per epoch; the paths' `data-points` say how many are drawn. */
  update(loss: number[], valLoss: number[]): void {
    const all = loss.concat(valLoss).filter(v => Number.isFinite(v));
    const lo = all.length ? Math.min(...all) : 0;
    const hi = all.length ? Math.max(...all) : 1;
    const n = Math.max(loss.length, valLoss.length);
    const x = (i: number) => (n <= 1 ? this.width / 2 : 2 + (i * (this.width - 4)) / (n - 1));
    const y = (v: number) => (hi === lo ? this.height / 2 : 2 + ((hi - v) * (this.height - 4)) / (hi - lo));
    const d = (vals: number[]) =>
      vals.map((v, i) => `${i ? 'L' : 'M'}${x(i).toFixed(1)},${y(v).toFixed(1)}`).join('');
    this.train.setAttribute('d', d(loss));
    this.train.setAttribute('data-points', String(loss.length));
    this.val.setAttribute('d', d(valLoss));
    this.val.setAttribute('data-points', String(valLoss.length));
  }
}
