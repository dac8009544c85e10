/**
 * Every job of the user, kept live from the backend's event log through the server extension.
 *
 * The model lists jobs once (which also gives the event cursor), then long-polls `events?after=cursor` and
 * applies each event (a study's own `study` events read its studies again); any failure switches to
 * "reconnecting" and, once an answer comes back, lists again, so a page reload, a Jupyter restart or a backend
 * restart all end in the same complete picture.
 */
import { ISignal, Signal } from '@lumino/signaling';

import { api, IEvent, IInstance, IJob, IMachine, IStudy } from './api';
import { FINAL } from './format';
import { applyEvent } from './jobpicture';

export type Connection = 'connecting' | 'live' | 'reconnecting';

const WAIT_S = 25;
const INSTANCE_REFRESH_MS = 5000;
/** Offers change slowly (spot prices, a Ray cluster's free nodes): the marketplace is fetched again this often. */
const MACHINE_REFRESH_MS = 30000;

export class JobsModel {
  jobs = new Map<string, IJob>();
  instances: IInstance[] = [];
  instancesFetched = 0;
  machines: IMachine[] = [];
  /** The studies whose trials are among the jobs, by id: the sidebar groups each study's trials under it. */
  studies = new Map<string, IStudy>();
  connection: Connection = 'connecting';
  lastError = '';

  private cursor = 0;
  private needsList = true;
  /** The backend's clock as of the newest event or job we have seen (seconds). */
  private serverNow = 0;
  /** serverNow when the picture went stale: a job that finished after it finished while we watched. */
  private horizon: number | null = null;
  private disposed = false;
  private changedSignal = new Signal<this, void>(this);
  private finishedSignal = new Signal<this, IJob>(this);
  private instanceTimer: number | undefined;
  private machinesFetched = 0;

  get changed(): ISignal<this, void> {
    return this.changedSignal;
  }

  /** A job reached COMPLETED or CANCELED while we watched it. */
  get finished(): ISignal<this, IJob> {
    return this.finishedSignal;
  }

  get activeCount(): number {
    let n = 0;
    this.jobs.forEach(j => (n += FINAL.has(j.status) ? 0 : 1));
    return n;
  }

  start(): void {
    void this.loop();
    this.instanceTimer = window.setInterval(() => {
      if (this.connection === 'live') {
        void this.refreshInstances();
        if (Date.now() - this.machinesFetched > MACHINE_REFRESH_MS) {
          void this.refreshMachines();
        }
      }
    }, INSTANCE_REFRESH_MS);
  }

  dispose(): void {
    this.disposed = true;
    window.clearInterval(this.instanceTimer);
  }

  /**
   * Ask the backend to cancel a job; the card says "Canceling…" until the CANCELED status arrives.
   * @returns the job as the backend has it once the cancel is recorded: a job that had already ended comes
   *   back with its final status and no `cancel_requested`, which the card says instead of waiting.
   * @throws {ApiError} when the proxy or the backend refuses (the job is unknown, the backend is away)
   */
  async cancel(jobId: string): Promise<IJob> {
    const answer = await api.cancel(jobId);
    const job = this.jobs.get(jobId);
    if (job) {
      // Only the flag: the picture stays the one the event stream builds, which may already be newer.
      job.cancel_requested = answer.cancel_requested;
      this.changedSignal.emit();
    }
    return answer;
  }

  /**
   * Cancel a study: no further trial starts and its running trials' jobs are cancelled.
   * @throws {ApiError} when the proxy or the backend refuses
   */
  async cancelStudy(studyId: string): Promise<void> {
    this.studies.set(studyId, await api.cancelStudy(studyId));
    this.changedSignal.emit();
  }

  /** The offer a machine id names, when the backend lists it. */
  machine(machineId: string | null | undefined): IMachine | undefined {
    return this.machines.find(m => m.machine_id === machineId);
  }

  /**
   * Close a cooling (or launching) instance now.
   * @throws {ApiError} when the proxy or the backend refuses (e.g. the instance is running a job)
   */
  async terminate(instanceId: string): Promise<void> {
    await api.terminate(instanceId);
    await this.refreshInstances();
  }

  private async loop(): Promise<void> {
    let backoff = 500;
    while (!this.disposed) {
      try {
        if (this.needsList) {
          await this.list();
        }
        const r = await api.events(this.cursor, WAIT_S);
        this.setConnection('live');
        backoff = 500;
        this.cursor = r.cursor;
        if (r.events.length) {
          this.apply(r.events);
        }
      } catch (error) {
        this.lastError = String((error as Error).message ?? error);
        this.markStale();
        this.setConnection('reconnecting');
        await new Promise(resolve => setTimeout(resolve, backoff));
        backoff = Math.min(backoff * 2, 5000);
      }
    }
  }

  private markStale(): void {
    this.needsList = true;
    this.horizon = this.horizon ?? this.serverNow;
  }

  private async list(): Promise<void> {
    const r = await api.jobs();
    const before = this.jobs;
    const horizon = this.horizon;
    this.jobs = new Map(r.jobs.map(j => [j.job_id, j]));
    this.cursor = r.cursor;
    this.needsList = false;
    this.horizon = null;
    this.jobs.forEach(job => {
      const ended = (job.timeline.length ? job.timeline[job.timeline.length - 1].ts : null) ?? job.created;
      this.serverNow = Math.max(this.serverNow, ended);
      const prev = before.get(job.job_id);
      const endedUnseen = prev ? !FINAL.has(prev.status) : horizon !== null && horizon > 0 && ended > horizon;
      if (FINAL.has(job.status) && endedUnseen) {
        this.finishedSignal.emit(job); // it ended while the stream was down or before we knew the job
      }
    });
    await this.refreshMachines(false);
    await this.refreshInstances(false);
    await this.refreshStudies(false);
    this.setConnection('live');
    this.changedSignal.emit();
  }

  private async refreshMachines(emit = true): Promise<void> {
    this.machinesFetched = Date.now();
    try {
      this.machines = (await api.machines()).machines;
    } catch {
      return; // the event loop notices a lost backend and says so
    }
    if (emit) {
      this.changedSignal.emit();
    }
  }

  private async refreshStudies(emit = true): Promise<void> {
    if (!Array.from(this.jobs.values()).some(j => j.study_id)) {
      return;
    }
    try {
      this.studies = new Map((await api.studies()).studies.map(s => [s.study_id, s]));
    } catch {
      return; // the event loop notices a lost backend and says so
    }
    if (emit) {
      this.changedSignal.emit();
    }
  }

  private async refreshInstances(emit = true): Promise<void> {
    try {
      this.instances = (await api.instances()).instances;
      this.instancesFetched = Date.now();
    } catch {
      return; // the event loop notices a lost backend and says so
    }
    if (emit) {
      this.changedSignal.emit();
    }
  }

  /** Events into the job pictures, by the one TypeScript reducer (jobpicture.ts); signals what they changed. */
  private apply(events: IEvent[]): void {
    let instancesChanged = false;
    let studiesChanged = false;
    for (const ev of events) {
      if (ev.type === 'study') {
        // A study's own log (a trial started or ended, the study ended): its group is read again, as a job's
        // card changes with its job's events; no clock polls the studies.
        this.serverNow = Math.max(this.serverNow, ev.ts);
        studiesChanged = true;
        continue;
      }
      const job = this.jobs.get(ev.job_id);
      if (!job) {
        this.markStale(); // a job started elsewhere (CLI, another kernel): the loop lists again
        continue;
      }
      this.serverNow = Math.max(this.serverNow, ev.ts);
      const wasFinal = FINAL.has(job.status);
      if (applyEvent(job, ev) === 'status') {
        instancesChanged = true;
        if (!wasFinal && FINAL.has(job.status)) {
          this.finishedSignal.emit(job);
        }
      }
    }
    if (instancesChanged) {
      void this.refreshInstances(false);
    }
    if (studiesChanged) {
      void this.refreshStudies(); // a trial started or ended (its score, the best so far), or the study ended
    }
    this.changedSignal.emit();
  }

  private setConnection(state: Connection): void {
    if (this.connection !== state) {
      this.connection = state;
      this.changedSignal.emit();
    }
  }
}
