/**
 * The "Cloud training" sidebar: jobs (live), instances (cooling countdown, Terminate) and machines.
 * Cards are built once per job and updated in place, so a click never lands on a node being replaced.
 */
import { Clipboard } from '@jupyterlab/apputils';
import { Widget } from '@lumino/widgets';

import { IInstance, IJob, IMachine } from './api';
import { duration, elapsed, FINAL, isActive, metrics, money } from './format';
import { JobsModel } from './model';
import { Sparkline } from './sparkline';

type Tab = 'jobs' | 'instances' | 'machines';

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

class JobCard {
  readonly node = el('div', 'aibro-job');
  private title = el('div', 'aibro-job-title');
  private state = el('div', 'aibro-job-state');
  private epochs = el('span', 'aibro-job-epochs');
  private bar = el('progress', 'aibro-job-bar');
  private metrics = el('div', 'aibro-job-metrics');
  private meta = el('div', 'aibro-job-meta');
  private error = el('div', 'aibro-job-error');
  private curve = new Sparkline();
  private cancel = el('button', 'jp-Button jp-mod-styled jp-mod-warn aibro-cancel', 'Cancel');
  private copy = el('button', 'jp-Button jp-mod-styled aibro-copy', 'Copy %cloud_attach');

  constructor(
    private job: IJob,
    private model: JobsModel
  ) {
    this.node.dataset.jobId = job.job_id;
    const progress = el('div', 'aibro-job-progress');
    progress.append(this.epochs, this.bar);
    const buttons = el('div', 'aibro-job-buttons');
    buttons.append(this.cancel, this.copy);
    this.node.append(
      this.title,
      this.state,
      progress,
      this.metrics,
      this.curve.node,
      this.meta,
      this.error,
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

  private async onCancel(): Promise<void> {
    this.cancel.disabled = true;
    this.cancel.textContent = 'Canceling…';
    try {
      await this.model.cancel(this.job.job_id);
    } catch (error) {
      this.error.textContent = `cancel failed: ${(error as Error).message}`;
      this.cancel.disabled = false;
      this.cancel.textContent = 'Cancel';
    }
  }

  update(job: IJob): void {
    this.job = job;
    const active = isActive(job);
    this.node.dataset.status = job.status;
    this.title.textContent = job.description ? `${job.description} · ${job.job_id}` : job.job_id;
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
      this.cancel.disabled = false;
      this.cancel.textContent = 'Cancel';
    } else if (active) {
      this.cancel.disabled = true;
      this.cancel.textContent = 'Canceling…';
    }
  }

  /** Elapsed time moves every second while the job is active. */
  tick(): void {
    const where = this.job.machine_id ?? this.job.machines.join(' → ');
    this.meta.textContent = `${where} · ${duration(elapsed(this.job))} · ${money(this.job.cost)}`;
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
  private cards = new Map<string, JobCard>();
  private timer: number;

  constructor(private model: JobsModel) {
    super();
    this.id = 'aibro-cloud-training';
    this.addClass('aibro-sidebar');
    this.title.caption = 'Cloud training';
    const header = el('div', 'aibro-header', 'Cloud training');
    const tabs = el('div', 'aibro-tabs');
    (Object.keys(this.tabButtons) as Tab[]).forEach(t => {
      this.tabButtons[t].onclick = () => this.showTab(t);
      tabs.appendChild(this.tabButtons[t]);
    });
    this.node.append(header, this.banner, tabs, this.panes.jobs, this.panes.instances, this.panes.machines);
    model.changed.connect(this.render, this);
    this.timer = window.setInterval(() => this.tick(), 1000);
    this.showTab('jobs');
  }

  dispose(): void {
    window.clearInterval(this.timer);
    super.dispose();
  }

  private showTab(tab: Tab): void {
    (Object.keys(this.panes) as Tab[]).forEach(t => {
      this.panes[t].hidden = t !== tab;
      this.tabButtons[t].classList.toggle('aibro-tab-active', t === tab);
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
    this.tabButtons.jobs.textContent = `Jobs (${m.activeCount} active)`;
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
      return;
    }
    const nodes: HTMLElement[] = [];
    for (const job of jobs) {
      let card = this.cards.get(job.job_id);
      if (card) {
        card.update(job);
      } else {
        card = new JobCard(job, this.model);
        this.cards.set(job.job_id, card);
      }
      nodes.push(card.node);
    }
    nodes.forEach((n, i) => {
      if (pane.children[i] !== n) {
        pane.insertBefore(n, pane.children[i] ?? null);
      }
    });
    while (pane.children.length > nodes.length) {
      pane.lastElementChild!.remove();
    }
  }

  private renderInstances(): void {
    const rows = this.model.instances.filter(i => i.status !== 'CLOSED');
    const pane = this.panes.instances;
    if (!rows.length) {
      pane.replaceChildren(el('div', 'aibro-empty', 'No live instances.'));
      return;
    }
    pane.replaceChildren(...rows.map(i => this.instanceRow(i)));
  }

  private instanceRow(inst: IInstance): HTMLElement {
    const row = el('div', 'aibro-instance');
    row.dataset.instanceId = inst.id;
    row.dataset.status = inst.status;
    const label = el('div', 'aibro-instance-label', `${inst.id} · ${inst.machine_id} · ${inst.status}`);
    const countdown = el('span', 'aibro-countdown');
    countdown.dataset.until = String(this.model.instancesFetched / 1000 + inst.cooling_left_s);
    row.append(label, countdown);
    if (inst.status === 'COOLING' || inst.status === 'LAUNCHING') {
      const term = el('button', 'jp-Button jp-mod-styled jp-mod-warn aibro-terminate', 'Terminate');
      term.onclick = () => {
        term.disabled = true;
        void this.model.terminate(inst.id).catch(error => {
          countdown.textContent = `terminate failed: ${(error as Error).message}`;
          term.disabled = false;
        });
      };
      row.appendChild(term);
    }
    this.tickCountdown(countdown, inst.status);
    return row;
  }

  private tickCountdown(node: HTMLElement, status: string): void {
    if (status !== 'COOLING') {
      node.textContent = '';
      return;
    }
    const left = Math.max(0, Number(node.dataset.until) - Date.now() / 1000);
    node.textContent = ` cooling, closes in ${duration(left)}`;
  }

  private renderMachines(): void {
    const table = el('table', 'aibro-machine-table');
    const head = el('tr', '');
    ['machine', 'provider', 'GPU', 'vCPUs', 'memory', '$/h spot', '$/h on-demand', 'availability'].forEach(h =>
      head.appendChild(el('th', '', h))
    );
    table.appendChild(head);
    this.model.machines.forEach((m: IMachine) => {
      const tr = el('tr', '');
      tr.dataset.machineId = m.machine_id;
      [
        m.machine_id,
        m.provider,
        m.gpu_count ? `${m.gpu_count}× ${m.gpu_type}` : '-',
        String(m.vcpus),
        `${m.memory_gib} GiB`,
        money(m.price_per_hour),
        money(m.on_demand_price_per_hour),
        m.availability
      ].forEach(c => tr.appendChild(el('td', '', c)));
      table.appendChild(tr);
    });
    this.panes.machines.replaceChildren(table);
  }

  private tick(): void {
    this.cards.forEach(c => c.tick());
    this.panes.instances.querySelectorAll<HTMLElement>('.aibro-instance').forEach(row => {
      const countdown = row.querySelector<HTMLElement>('.aibro-countdown');
      if (countdown) {
        this.tickCountdown(countdown, row.dataset.status ?? '');
      }
    });
  }
}
