/**
 * aibro-jupyter's JupyterLab side: a "Cloud training" sidebar, a status-bar count of active jobs and a
 * notification when a job completes or fails. Everything comes through the server extension's `/aibro/api`.
 */
import { ILayoutRestorer, JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { ICommandPalette, Notification } from '@jupyterlab/apputils';
import { IStatusBar } from '@jupyterlab/statusbar';
import { LabIcon } from '@jupyterlab/ui-components';

import { IJob } from './api';
import { metrics } from './format';
import { JobStatus } from './statuses';
import { JobsModel } from './model';
import { CloudSidebar } from './sidebar';
import { ActiveJobsItem } from './statusbar';

const CLOUD_SVG =
  '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24" width="16"><path class="jp-icon3" ' +
  'fill="#616161" d="M19.35 10.04A7.49 7.49 0 0 0 12 4C9.11 4 6.6 5.64 5.35 8.04A5.994 5.994 0 0 0 0 14c0 ' +
  '3.31 2.69 6 6 6h13c2.76 0 5-2.24 5-5 0-2.64-2.05-4.78-4.65-4.96z"/></svg>';

const cloudIcon = new LabIcon({ name: 'aibro-jupyter:cloud', svgstr: CLOUD_SVG });

/** The job's id goes on a line of its own after a description: mid-sentence, the toast broke it at a hyphen. */
function announce(job: IJob): void {
  const name = job.description || job.job_id;
  const id = job.description ? `\n${job.job_id}` : '';
  if (job.status === JobStatus.COMPLETED) {
    const last = job.history.length ? job.history[job.history.length - 1] : undefined;
    Notification.success(`${name} completed · ${metrics(last)}${id}`, { autoClose: 8000 });
  } else if (job.error) {
    const why = job.error.length > 80 ? `${job.error.slice(0, 79)}…` : job.error;
    Notification.error(`${name} failed: ${why}${id}`, { autoClose: false });
  } else {
    Notification.info(`${name} was canceled${id}`, { autoClose: 5000 });
  }
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'aibro-jupyter:sidebar',
  description: 'Monitor and control cloud training jobs without a kernel.',
  autoStart: true,
  optional: [ILayoutRestorer, IStatusBar, ICommandPalette],
  activate: (
    app: JupyterFrontEnd,
    restorer: ILayoutRestorer | null,
    statusBar: IStatusBar | null,
    palette: ICommandPalette | null
  ) => {
    const model = new JobsModel();
    const sidebar = new CloudSidebar(model);
    sidebar.title.icon = cloudIcon;
    app.shell.add(sidebar, 'left', { rank: 850 });
    restorer?.add(sidebar, sidebar.id);

    const command = 'aibro-jupyter:open-sidebar';
    app.commands.addCommand(command, {
      label: 'Show Cloud Training',
      execute: () => app.shell.activateById(sidebar.id)
    });
    palette?.addItem({ command, category: 'Cloud training' });

    statusBar?.registerStatusItem('aibro-jupyter:active-jobs', {
      item: new ActiveJobsItem(model, () => app.shell.activateById(sidebar.id)),
      align: 'left',
      rank: 50
    });

    model.finished.connect((_, job) => announce(job));
    model.start();
  }
};

export default plugin;
