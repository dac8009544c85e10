/** Status-bar item: how many of the user's jobs are active; a click opens the sidebar. */
import { Widget } from '@lumino/widgets';

import { JobsModel } from './model';

export class ActiveJobsItem extends Widget {
  constructor(
    private model: JobsModel,
    onClick: () => void
  ) {
    super();
    this.addClass('aibro-statusbar');
    this.node.title = 'Cloud training jobs';
    this.node.onclick = onClick;
    model.changed.connect(this.render, this);
    this.render();
  }

  private render(): void {
    const n = this.model.activeCount;
    const lost = this.model.connection === 'reconnecting' ? ' (reconnecting)' : '';
    this.node.textContent = `☁ ${n} training${lost}`;
    this.node.dataset.active = String(n);
  }
}
