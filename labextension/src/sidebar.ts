/**
 * The "Cloud training" sidebar: jobs (live), instances (state with times, cooling countdown, Terminate) and the
 * machines on offer (a table sortable by price, GPU, vCPU, memory and availability).
 * A study's trials sit under their study, with its best trial so far.
 * Cards are built once per job and updated in place, so a click never lands on a node being replaced.
 * Every element keeps inside the sidebar at JupyterLab's default width: long names end in an ellipsis (the full
 * text is the tooltip), buttons wrap to a new line rather than out of their box, the machine table scrolls
 * sideways inside its own box with the prices in the first columns.
 */
import { Clipboard } from '@jupyterlab/apputils';
import { Widget } from '@lumino/widgets';

import { IInstance, IJob, IMachine, IStudy } from './api';
import { clock, duration, elapsed, FINAL, isActive, metrics, money, price } from './format';
import { JobsModel } from './model';
import { Sparkline } from './sparkline';
import { InstanceEnding, InstanceStatus, StudyStatus, TrialStatus } from './statuses';

type Tab = 'jobs' | 'instances' | 'machines';
const SORT_HINT = 'Click a column to sort; prices are per hour.';
type SortKey = 'machine' | 'price' | 'gpu' | 'vcpus' | 'memory' | 'availability';

function el<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  cls: string,
  text = ''
): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag);
  node.className = cls;
  node.textContent = text;
  return node;
}

/** A one-line text that ends in an ellipsis when it does not fit; the whole of it is the tooltip. */
function line(cls: string, text: string): HTMLDivElement {
  const node = el('div', `aibro-line ${cls}`, text);
  node.title = text;
  return node;
}

/** What a job costs so far: "free" on a machine with no price, dollars otherwise. */
function jobCost(job: IJob, model: JobsModel): string {
  const offer = model.machine(job.machine_id ?? job.machines[0]);
  return job.cost || (offer && offer.price_per_hour) ? money(job.cost) : 'free';
}

class JobCard {
  readonly node = el('div', 'aibro-job');
  private title = line('aibro-job-title', '');
  private jobId = line('aibro-job-id', '');
  private state = el('div', 'aibro-job-state');
  private epochs = el('span', 'aibro-job-epochs');
  private bar = el('progress', 'aibro-job-bar');
  private metrics = el('div', 'aibro-job-metrics');
  private meta = el('div', 'aibro-job-meta');
  private error = el('div', 'aibro-job-error');
  private note = el('div', 'aibro-job-note');
  private curve = new Sparkline();
  private cancel = el('button', 'jp-Button jp-mod-styled jp-mod-warn aibro-cancel', 'Cancel');
  private copy = el('button', 'jp-Button jp-mod-styled aibro-copy', 'Copy %cloud_attach');
  /** A cancel request is on its way: renders meanwhile leave the button as "Canceling…". */
  private pending = false;

  constructor(
    public job: IJob,
    private model: JobsModel
  ) {
    this.node.dataset.jobId = job.job_id;
    const progress = el('div', 'aibro-job-progress');
    progress.append(this.epochs, this.bar);
    const buttons = el('div', 'aibro-job-buttons');
    buttons.append(this.cancel, this.copy);
    this.copy.title = `Copy "%cloud_attach ${job.job_id}": run it in a notebook cell to follow this job there`;
    this.node.append(
      this.title,
      this.jobId,
      this.state,
      progress,
      this.metrics,
      this.curve.node,
      this.meta,
      this.error,
      this.note,
      buttons
    );
    this.cancel.onclick = () => void this.onCancel();
    this.copy.onclick = () => {
      Clipboard.copyToSystem(`%cloud_attach ${this.job.job_id}`);
      this.copy.textContent = 'Copied';
      window.setTimeout(() => (this.copy.textContent = 'Copy %cloud_attach'), 1500);
    };
    this.update(job);
  }

  /** Cancel, and say what came of it: the backend's refusal, or that the job had already ended. */
  private async onCancel(): Promise<void> {
    this.pending = true;
    try {
      const answer = await requestCancel(this.cancel, this.note, () => this.model.cancel(this.job.job_id));
      if (answer && !answer.cancel_requested && FINAL.has(answer.status)) {
        this.note.textContent = `already ${answer.status}: nothing to cancel`;
        this.cancel.hidden = true;
      }
    } finally {
      this.pending = false;
    }
  }

  update(job: IJob): void {
    this.job = job;
    const active = isActive(job);
    this.node.dataset.status = job.status;
    const name = job.trial_id ? `trial ${job.trial_id}` : job.description; // under its study's name
    this.title.textContent = this.title.title = name || job.job_id;
    this.jobId.textContent = this.jobId.title = job.job_id;
    this.jobId.hidden = !name;
    this.state.textContent = `${job.status} · ${job.substatus}`;
    this.epochs.textContent = `epoch ${job.epochs_done}/${job.epochs}`;
    this.bar.max = Math.max(1, job.epochs);
    this.bar.value = job.epochs_done;
    const last = job.history.length ? job.history[job.history.length - 1] : undefined;
    this.metrics.textContent = metrics(last);
    this.curve.update(
      job.history.map(h => h.loss ?? NaN),
      job.history.filter(h => h.val_loss !== undefined).map(h => h.val_loss ?? NaN)
    );
    this.tick();
    this.error.textContent = job.error ?? '';
    this.cancel.hidden = !active;
    if (active && !job.cancel_requested) {
      if (!this.pending) {
        this.cancel.disabled = false;
        this.cancel.textContent = 'Cancel';
      }
    } else if (active) {
      this.cancel.disabled = true;
      this.cancel.textContent = 'Canceling…';
    }
  }

  /** Elapsed time moves every second while the job is active. */
  tick(): void {
    const machine = this.job.machine_id ?? this.job.machines.join(' → ');
    const workers = this.job.workers ?? 1;
    const where = workers > 1 ? `${machine} · ${workers} workers` : machine;
    this.meta.textContent = `${where} · ${duration(elapsed(this.job))} · ${jobCost(this.job, this.model)}`;
  }
}

/**
 * The button reads "Canceling…" while `request` runs; a refusal is said in `note` and the button is offered again.
 * Resolves to the backend's answer, or undefined when the request failed.
 */
async function requestCancel<T>(
  button: HTMLButtonElement,
  note: HTMLElement,
  request: () => Promise<T>
): Promise<T | undefined> {
  const label = button.textContent;
  note.textContent = '';
  button.disabled = true;
  button.textContent = 'Canceling…';
  try {
    return await request();
  } catch (error) {
    note.textContent = `cancel failed: ${(error as Error).message}`;
    button.disabled = false;
    button.textContent = label;
    return undefined;
  }
}

/** Put `nodes` into `box` in this order, moving only what moved (a node being clicked is never replaced). */
function place(box: HTMLElement, nodes: HTMLElement[]): void {
  nodes.forEach((n, i) => {
    if (box.children[i] !== n) {
      box.insertBefore(n, box.children[i] ?? null);
    }
  });
  while (box.children.length > nodes.length) {
    box.lastElementChild!.remove();
  }
}

/** "best val_loss 0.1234 · trial 03", or why there is none yet. */
function bestSoFar(study: IStudy): string {
  const best = study.trials.find(t => t.trial_id === study.best_trial_id);
  const objective = study.objective[0]?.name ?? 'score';
  if (!best || best.score === null || best.score === undefined) {
    return study.trials.length ? 'no trial completed yet' : 'no trial yet';
  }
  return `best ${objective} ${Number(best.score).toFixed(4)} · trial ${best.trial_id}`;
}

/** A hyperparameter study: its state, trial count, best so far and cost, then its trials' cards. */
class StudyGroup {
  readonly node = el('div', 'aibro-study');
  readonly trials = el('div', 'aibro-study-trials');
  private title = line('aibro-study-title', '');
  private state = el('div', 'aibro-study-state');
  private best = el('div', 'aibro-study-best');
  private meta = el('div', 'aibro-study-meta');
  private note = el('div', 'aibro-job-note');
  private cancel = el('button', 'jp-Button jp-mod-styled jp-mod-warn aibro-cancel-study', 'Cancel study');

  constructor(
    private studyId: string,
    private model: JobsModel
  ) {
    this.node.dataset.studyId = studyId;
    const buttons = el('div', 'aibro-job-buttons');
    buttons.append(this.cancel);
    this.node.append(this.title, this.state, this.best, this.meta, this.note, buttons, this.trials);
    this.cancel.onclick = () => void this.onCancel();
  }

  private async onCancel(): Promise<void> {
    await requestCancel(this.cancel, this.note, () => this.model.cancelStudy(this.studyId));
  }

  update(jobs: IJob[]): void {
    const study = this.model.studies.get(this.studyId);
    const running = study ? study.status === StudyStatus.RUNNING : jobs.some(isActive);
    this.node.dataset.status = study?.status ?? StudyStatus.RUNNING;
    this.title.textContent = this.title.title = study?.description || this.studyId;
    const done = study ? study.trials.filter(t => t.status !== TrialStatus.RUNNING).length : 0;
    const of = study?.max_trials ? `/${study.max_trials}` : '';
    this.state.textContent = study ? `${study.status} · ${done}${of} trials · ${study.kind}` : '';
    this.state.title = study ? `${study.parallel} trials at once` : '';
    this.best.textContent = study ? bestSoFar(study) : '';
    const cost = study?.cost ?? jobs.reduce((sum, j) => sum + j.cost, 0);
    const start = study?.created ?? Math.min(...jobs.map(j => j.created));
    const end = running ? Date.now() / 1000 : (study?.updated ?? start);
    const free = !cost && jobs.every(j => jobCost(j, this.model) === 'free');
    const shown = free ? 'free' : money(cost);
    this.meta.textContent = `${this.studyId} · ${duration(Math.max(0, end - start))} · ${shown}`;
    this.cancel.hidden = !running;
  }
}

/** Instance transitions as "LAUNCHING 17:04:09 → EXECUTING 17:04:12", one step per status. */
function steps(inst: IInstance): [string, number][] {
  const out: [string, number][] = [];
  for (const entry of inst.history) {
    const [status, , ts] = entry as [string, string, number];
    if (typeof ts === 'number' && (!out.length || out[out.length - 1][0] !== status)) {
      out.push([status, ts]);
    }
  }
  return out;
}

/** The substatuses that only say how a machine went away, not why. */
const PLAIN_ENDINGS = new Set<string>(['', ...Object.values(InstanceEnding)]);

/** Why a closing or closed instance closed, when its last transitions say more than how (an agent refused). */
function closedBecause(inst: IInstance): string | undefined {
  for (let i = inst.history.length - 1; i >= 0; i--) {
    const [status, sub] = inst.history[i] as [string, string];
    if (status !== InstanceStatus.CLOSING && status !== InstanceStatus.CLOSED) {
      return undefined;
    }
    if (typeof sub === 'string' && !PLAIN_ENDINGS.has(sub)) {
      return sub;
    }
  }
  return undefined;
}

const AVAILABILITY_ORDER: Record<string, number> = { available: 0, busy: 1 };

const COLUMNS: { key: SortKey; label: string; title: string }[] = [
  { key: 'machine', label: 'Machine', title: 'machine id and provider' },
  { key: 'price', label: '$/h', title: 'price per hour of this offer (spot or on-demand)' },
  { key: 'gpu', label: 'GPU', title: 'GPUs' },
  { key: 'vcpus', label: 'vCPU', title: 'virtual CPUs' },
  { key: 'memory', label: 'Mem', title: 'memory (GiB)' },
  { key: 'availability', label: 'Avail', title: 'availability now' }
];

function compareMachines(key: SortKey): (a: IMachine, b: IMachine) => number {
  switch (key) {
    case 'price':
      return (a, b) => a.price_per_hour - b.price_per_hour;
    case 'gpu':
      return (a, b) => a.gpu_count - b.gpu_count || (a.gpu_type ?? '').localeCompare(b.gpu_type ?? '');
    case 'vcpus':
      return (a, b) => a.vcpus - b.vcpus;
    case 'memory':
      return (a, b) => a.memory_gib - b.memory_gib;
    case 'availability':
      return (a, b) => (AVAILABILITY_ORDER[a.availability] ?? 2) - (AVAILABILITY_ORDER[b.availability] ?? 2);
    default:
      return (a, b) => a.machine_id.localeCompare(b.machine_id);
  }
}

export class CloudSidebar extends Widget {
  private banner = el('div', 'aibro-connection');
  private panes: Record<Tab, HTMLElement> = {
    jobs: el('div', 'aibro-pane aibro-jobs'),
    instances: el('div', 'aibro-pane aibro-instances'),
    machines: el('div', 'aibro-pane aibro-machines')
  };
  private tabButtons: Record<Tab, HTMLButtonElement> = {
    jobs: el('button', 'aibro-tab', 'Jobs'),
    instances: el('button', 'aibro-tab', 'Instances'),
    machines: el('button', 'aibro-tab', 'Machines')
  };
  private activeBadge = el('span', 'aibro-badge');
  private cards = new Map<string, JobCard>();
  private groups = new Map<string, StudyGroup>();
  private timer: number;
  private machineScroll = el('div', 'aibro-machine-scroll');
  private machineHint = el('div', 'aibro-hint', SORT_HINT);
  private resized = new ResizeObserver(() => this.fitMachines());
  private machinesDrawn: { machines: IMachine[]; key: SortKey; dir: number } | null = null;
  private sortKey: SortKey = 'price';
  private sortDir = 1;

  constructor(private model: JobsModel) {
    super();
    this.id = 'aibro-cloud-training';
    this.addClass('aibro-sidebar');
    this.title.caption = 'Cloud training';
    const header = el('div', 'aibro-header', 'Cloud training');
    const tabs = el('div', 'aibro-tabs');
    tabs.setAttribute('role', 'tablist');
    (Object.keys(this.tabButtons) as Tab[]).forEach(t => {
      this.tabButtons[t].onclick = () => this.showTab(t);
      this.tabButtons[t].dataset.tab = t;
      this.tabButtons[t].setAttribute('role', 'tab');
      tabs.appendChild(this.tabButtons[t]);
    });
    this.panes.machines.append(this.machineHint, this.machineScroll);
    this.resized.observe(this.machineScroll);
    this.node.append(header, this.banner, tabs, this.panes.jobs, this.panes.instances, this.panes.machines);
    model.changed.connect(this.render, this);
    this.timer = window.setInterval(() => this.tick(), 1000);
    this.showTab('jobs');
  }

  dispose(): void {
    window.clearInterval(this.timer);
    this.resized.disconnect();
    super.dispose();
  }

  private showTab(tab: Tab): void {
    (Object.keys(this.panes) as Tab[]).forEach(t => {
      this.panes[t].hidden = t !== tab;
      this.tabButtons[t].classList.toggle('aibro-tab-active', t === tab);
      this.tabButtons[t].setAttribute('aria-selected', String(t === tab));
    });
    this.render();
  }

  private render(): void {
    const m = this.model;
    this.banner.dataset.state = m.connection;
    this.banner.textContent =
      m.connection === 'live'
        ? 'live'
        : m.connection === 'reconnecting'
          ? `reconnecting… (${m.lastError})`
          : 'connecting…';
    this.banner.title = this.banner.textContent;
    const active = m.activeCount;
    this.activeBadge.textContent = String(active);
    this.activeBadge.hidden = !active;
    this.tabButtons.jobs.replaceChildren('Jobs ', this.activeBadge);
    this.tabButtons.jobs.title = `${active} active job${active === 1 ? '' : 's'}`;
    this.renderJobs();
    this.renderInstances();
    this.renderMachines();
  }

  private renderJobs(): void {
    const pane = this.panes.jobs;
    const jobs = Array.from(this.model.jobs.values()).sort(
      (a, b) => Number(FINAL.has(a.status)) - Number(FINAL.has(b.status)) || b.created - a.created
    );
    if (!jobs.length) {
      pane.replaceChildren(el('div', 'aibro-empty', 'No jobs yet: run a %%cloud_fit cell or `aibro fit`.'));
      this.cards.clear();
      this.groups.clear();
      return;
    }
    const nodes: HTMLElement[] = [];
    const trials = new Map<string, JobCard[]>();
    for (const job of jobs) {
      let card = this.cards.get(job.job_id);
      if (card) {
        card.update(job);
      } else {
        card = new JobCard(job, this.model);
        this.cards.set(job.job_id, card);
      }
      if (!job.study_id) {
        nodes.push(card.node);
        continue;
      }
      let group = this.groups.get(job.study_id);
      if (!group) {
        group = new StudyGroup(job.study_id, this.model);
        this.groups.set(job.study_id, group);
      }
      if (!trials.has(job.study_id)) {
        trials.set(job.study_id, []);
        nodes.push(group.node); // where its newest trial sorts: a running study stays on top
      }
      trials.get(job.study_id)!.push(card);
    }
    this.groups.forEach((_, id) => trials.has(id) || this.groups.delete(id)); // studies no longer listed
    trials.forEach((cards, studyId) => {
      const group = this.groups.get(studyId)!;
      group.update(cards.map(c => c.job));
      const order = [...cards].sort((a, b) => a.job.trial_id!.localeCompare(b.job.trial_id!));
      place(group.trials, order.map(c => c.node));
    });
    place(pane, nodes);
  }

  /** Live instances first, then the five most recently closed ones (their history says how they ended). */
  private renderInstances(): void {
    const all = [...this.model.instances].sort((a, b) => b.updated - a.updated);
    const live = all.filter(i => i.status !== InstanceStatus.CLOSED);
    const closed = all.filter(i => i.status === InstanceStatus.CLOSED).slice(0, 5);
    const pane = this.panes.instances;
    const nodes: HTMLElement[] = live.length
      ? live.map(i => this.instanceRow(i))
      : [el('div', 'aibro-empty', 'No live instances.')];
    if (closed.length) {
      nodes.push(el('div', 'aibro-subhead', 'Recently closed'), ...closed.map(i => this.instanceRow(i)));
    }
    pane.replaceChildren(...nodes);
  }

  private instanceRow(inst: IInstance): HTMLElement {
    const row = el('div', 'aibro-instance');
    row.dataset.instanceId = inst.id;
    row.dataset.status = inst.status;
    const head = el('div', 'aibro-instance-head');
    const badge = el('span', 'aibro-state-badge', inst.status);
    badge.dataset.status = inst.status;
    head.append(badge, line('aibro-instance-id', inst.id));
    const where = line('aibro-instance-machine', `${inst.machine_id} · ${inst.provider}`);
    const since = el('div', 'aibro-instance-since');
    since.dataset.since = String(this.latestStep(inst));
    const countdown = el('span', 'aibro-countdown');
    countdown.dataset.until = String(this.model.instancesFetched / 1000 + inst.cooling_left_s);
    const timeline = el('div', 'aibro-instance-steps');
    const all = steps(inst);
    // An instance that ran many jobs: its launch, then its last few transitions (the tooltip has them all).
    const shown = all.length > 5 ? [all[0], null, ...all.slice(-3)] : all;
    timeline.title = all.map(([status, ts]) => `${status} ${clock(ts)}`).join(' → ');
    shown.forEach((entry, i) => {
      const text = entry ? `${entry[0]} ${clock(entry[1])}` : `… ${all.length - 4} more`;
      const step = el('span', 'aibro-step', `${i ? '→ ' : ''}${text}`);
      step.dataset.status = entry ? entry[0] : '';
      timeline.appendChild(step);
    });
    const why = closedBecause(inst) ?? inst.substatus;
    if (why && why !== inst.status) {
      timeline.appendChild(el('span', 'aibro-step aibro-substatus', `(${why})`));
    }
    row.append(head, where, since, countdown, timeline);
    const job = this.lastJob(inst);
    if (job) {
      const verb = job.job_id === inst.job_id ? 'running' : 'last ran';
      const text = `${verb} ${job.description || job.job_id} · ${jobCost(job, this.model)}`;
      row.appendChild(line('aibro-instance-job', text));
    }
    if (inst.status === InstanceStatus.COOLING || inst.status === InstanceStatus.LAUNCHING) {
      const term = el('button', 'jp-Button jp-mod-styled jp-mod-warn aibro-terminate', 'Terminate');
      term.onclick = () => {
        term.disabled = true;
        void this.model.terminate(inst.id).catch(error => {
          countdown.textContent = `terminate failed: ${(error as Error).message}`;
          term.disabled = false;
        });
      };
      const buttons = el('div', 'aibro-job-buttons');
      buttons.appendChild(term);
      row.appendChild(buttons);
    }
    this.tickInstance(row);
    return row;
  }

  /** The job the instance runs, or else the last one it ran (a cooling instance waits for the next). */
  private lastJob(inst: IInstance): IJob | undefined {
    const running = inst.job_id ? this.model.jobs.get(inst.job_id) : undefined;
    const ran = Array.from(this.model.jobs.values()).filter(j => j.instance_id === inst.id);
    return running ?? ran.sort((a, b) => b.created - a.created)[0];
  }

  /** When the instance entered its present status (the backend's clock, seconds). */
  private latestStep(inst: IInstance): number {
    const all = steps(inst);
    return all.length ? all[all.length - 1][1] : inst.updated;
  }

  private tickInstance(row: HTMLElement): void {
    const status = row.dataset.status ?? '';
    const since = row.querySelector<HTMLElement>('.aibro-instance-since');
    if (since) {
      const t = Number(since.dataset.since);
      since.textContent =
        status === InstanceStatus.CLOSED
          ? `closed at ${clock(t)}`
          : `${status.toLowerCase()} since ${clock(t)} (${duration(Date.now() / 1000 - t)})`;
    }
    const countdown = row.querySelector<HTMLElement>('.aibro-countdown');
    if (countdown && !countdown.textContent?.startsWith('terminate failed')) {
      const left = Math.max(0, Number(countdown.dataset.until) - Date.now() / 1000);
      countdown.textContent = status === InstanceStatus.COOLING ? `closes in ${duration(left)} unless a job comes` : '';
      countdown.hidden = status !== InstanceStatus.COOLING;
    }
  }

  private sortBy(key: SortKey): void {
    this.sortDir = this.sortKey === key ? -this.sortDir : 1;
    this.sortKey = key;
    this.renderMachines();
  }

  /** The marketplace: one row per offer, the price first so it shows without scrolling. */
  private renderMachines(): void {
    const machines = this.model.machines;
    const drawn = this.machinesDrawn;
    if (drawn && drawn.machines === machines && drawn.key === this.sortKey && drawn.dir === this.sortDir) {
      return;
    }
    this.machinesDrawn = { machines, key: this.sortKey, dir: this.sortDir };
    const table = el('table', 'aibro-machine-table');
    const head = el('tr', '');
    COLUMNS.forEach(c => {
      const th = el('th', '');
      const button = el('button', 'aibro-sort', c.label);
      button.dataset.sort = c.key;
      button.title = `sort by ${c.title}`;
      button.onclick = () => this.sortBy(c.key);
      if (c.key === this.sortKey) {
        th.setAttribute('aria-sort', this.sortDir > 0 ? 'ascending' : 'descending');
        button.textContent = `${c.label} ${this.sortDir > 0 ? '▲' : '▼'}`;
      }
      th.appendChild(button);
      head.appendChild(th);
    });
    table.appendChild(head);
    const cmp = compareMachines(this.sortKey);
    const rows = [...machines].sort(
      (a, b) => this.sortDir * cmp(a, b) || a.price_per_hour - b.price_per_hour
    );
    rows.forEach((m: IMachine) => {
      const tr = el('tr', '');
      tr.dataset.machineId = m.machine_id;
      tr.dataset.provider = m.provider;
      tr.dataset.availability = m.availability;
      const market = m.price_per_hour ? (m.spot ? 'spot' : 'on-demand') : m.provider;
      const name = el('td', 'aibro-machine-name');
      name.append(line('', m.machine_id), el('div', 'aibro-sub', m.provider));
      const cost = el('td', 'aibro-price');
      cost.append(el('div', '', price(m.price_per_hour)), el('div', 'aibro-sub', market));
      if (m.spot && m.on_demand_price_per_hour) {
        cost.title = `spot; on-demand is ${price(m.on_demand_price_per_hour)}/h`;
      }
      tr.append(
        name,
        cost,
        el('td', '', m.gpu_count ? `${m.gpu_count}× ${m.gpu_type ?? 'GPU'}` : '–'),
        el('td', 'aibro-num', String(m.vcpus)),
        el('td', 'aibro-num', `${m.memory_gib}G`),
        el('td', 'aibro-avail', m.availability)
      );
      tr.lastElementChild!.setAttribute('data-availability', m.availability);
      table.appendChild(tr);
    });
    const left = this.machineScroll.scrollLeft; // a refresh leaves the table scrolled where the user put it
    this.machineScroll.replaceChildren(table);
    this.machineScroll.scrollLeft = left;
    this.fitMachines();
  }

  /** Says so when the table is wider than the sidebar: a scrollbar alone may be hidden until hovered. */
  private fitMachines(): void {
    const box = this.machineScroll;
    const more = box.scrollWidth > box.clientWidth + 1;
    box.classList.toggle('aibro-wider', more);
    this.machineHint.textContent = more ? `${SORT_HINT} Scroll sideways for more columns →` : SORT_HINT;
  }

  private tick(): void {
    this.cards.forEach(c => c.tick());
    const byStudy = new Map<string, IJob[]>();
    for (const job of this.model.jobs.values()) {
      if (job.study_id) {
        byStudy.set(job.study_id, [...(byStudy.get(job.study_id) ?? []), job]);
      }
    }
    this.groups.forEach((g, id) => g.update(byStudy.get(id) ?? []));
    this.panes.instances.querySelectorAll<HTMLElement>('.aibro-instance').forEach(row => this.tickInstance(row));
  }
}
