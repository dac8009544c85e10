/** Small formatters shared by the sidebar and the status bar. */
import { HistoryRow, IJob } from './api';
import { JobStatus } from './statuses';

/** The statuses a job never leaves. */
export const FINAL: ReadonlySet<JobStatus> = new Set<JobStatus>([JobStatus.COMPLETED, JobStatus.CANCELED]);

export function isActive(job: IJob): boolean {
  return !FINAL.has(job.status);
}

export function elapsed(job: IJob, now: number = Date.now() / 1000): number {
  const start = (job.timeline.length ? job.timeline[0].ts : null) ?? job.created;
  const last = (job.timeline.length ? job.timeline[job.timeline.length - 1].ts : null) ?? now;
  return Math.max(0, (isActive(job) ? now : last) - start);
}

export function duration(seconds: number): string {
  const s = Math.floor(seconds);
  const h = Math.floor(s / 3600);
  const m = Math.floor((s % 3600) / 60);
  const sec = s % 60;
  const pad = (n: number) => String(n).padStart(2, '0');
  return h ? `${h}:${pad(m)}:${pad(sec)}` : `${m}:${pad(sec)}`;
}

export function money(value: number): string {
  return `$${value.toFixed(2)}`;
}

/**
 * An hourly price the way clouds list them ("$0.526", "$32.77", "<$0.001" for less than a tenth of a cent),
 * "free" for a machine that costs nothing (local, a Ray cluster of one's own).
 */
export function price(value: number | null | undefined): string {
  if (!value) {
    return 'free';
  }
  return value < 0.001 ? '<$0.001' : `$${value.toFixed(value < 10 ? 3 : 2)}`;
}

/** A backend timestamp (seconds) as the browser's local wall-clock time, "17:04:09". */
export function clock(ts: number): string {
  return new Date(ts * 1000).toLocaleTimeString([], { hour12: false });
}

/** "loss 0.1234 · accuracy 0.9650" for the last epoch's logs, validation metrics included. */
export function metrics(logs: HistoryRow | undefined): string {
  if (!logs) {
    return '';
  }
  return Object.keys(logs)
    .filter(k => k !== 'epoch' && k !== 'learning_rate' && typeof logs[k] === 'number')
    .map(k => `${k} ${Number(logs[k]).toFixed(4)}`)
    .join(' · ');
}
