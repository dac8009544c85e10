/**
 * The one event → job-picture reduction in TypeScript, the counterpart of backend/aibro_core/jobpicture.py: status
 * events move status/substatus and the timeline, epoch events put one history row per epoch (a resumed attempt's
 * epoch replaces the lost one's), error events set the error. An event it cannot use (a status outside the
 * vocabulary, an epoch without logs) changes nothing, as in Python. tests/test_job_pictures.py runs both reducers
 * over the same event logs (tests/fixtures/event_logs.json).
 */
import type { HistoryRow, IJob } from './api';
import { jobStatusValues, jobSubstatusValues } from './generated/openapi';

/** The fields of a job that its events decide. */
export type JobPictureFields = Pick<
  IJob,
  'status' | 'substatus' | 'timeline' | 'history' | 'epochs_done' | 'epochs' | 'error' | 'machine_id'
>;

/** What an applied event changed; null when the event was not one the picture can use. */
export type Applied = 'status' | 'epoch' | 'error' | null;

/** An event as the backend stores it (the fields the reduction reads). */
export interface IEventLike {
  type: string;
  data: unknown;
  ts: number | null;
}

function member<T>(values: ReadonlyArray<T>, value: unknown): value is T {
  return (values as ReadonlyArray<unknown>).includes(value);
}

function finiteOrNull(value: unknown): number | null {
  return typeof value === 'number' && Number.isFinite(value) ? value : null;
}

export function applyEvent(job: JobPictureFields, ev: IEventLike): Applied {
  const d = ev.data;
  if (!d || typeof d !== 'object' || Array.isArray(d)) {
    return null;
  }
  const data = d as Record<string, unknown>;
  if (ev.type === 'status') {
    const status = 'status' in data ? data.status : job.status;
    const substatus = 'substatus' in data ? data.substatus : job.substatus;
    if (!member(jobStatusValues, status) || !member(jobSubstatusValues, substatus)) {
      return null;
    }
    job.status = status;
    job.substatus = substatus;
    job.timeline.push({ status, substatus, ts: finiteOrNull(ev.ts) ?? 0 });
    if (typeof data.machine_id === 'string') {
      job.machine_id = data.machine_id;
    }
    return 'status';
  }
  if (ev.type === 'epoch') {
    const epoch = data.epoch;
    const logs = data.logs;
    if (typeof epoch !== 'number' || !Number.isInteger(epoch) || epoch < 0) {
      return null;
    }
    if (!logs || typeof logs !== 'object' || Array.isArray(logs)) {
      return null;
    }
    const entry: HistoryRow = { epoch: epoch + 1 };
    Object.entries(logs as Record<string, unknown>).forEach(([k, value]) => {
      if (k !== 'epoch') {
        entry[k] = finiteOrNull(value);
      }
    });
    job.history = job.history.filter(h => h.epoch !== entry.epoch).concat([entry]);
    job.history.sort((a, b) => a.epoch - b.epoch);
    job.epochs_done = Math.max(job.epochs_done, entry.epoch);
    const epochs = data.epochs;
    if (typeof epochs === 'number' && Number.isInteger(epochs) && epochs > 0) {
      job.epochs = epochs;
    }
    return 'epoch';
  }
  if (ev.type === 'error') {
    job.error = 'message' in data ? String(data.message) : '';
    return 'error';
  }
  return null;
}
