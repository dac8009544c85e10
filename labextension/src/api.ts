/**
 * The labextension's only way out: `/aibro/api/*` on the Jupyter server, which holds the backend's token.
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

export interface ITimelineEntry {
  status: string;
  substatus: string;
  ts: number;
}

export type Logs = { [key: string]: number };

export interface IJob {
  job_id: string;
  status: string;
  substatus: string;
  description: string;
  machine_id: string | null;
  machines: string[];
  epochs: number;
  epochs_done: number;
  created: number;
  cost: number;
  cancel_requested: number | boolean;
  timeline: ITimelineEntry[];
  history: Array<Logs & { epoch: number }>;
  error: string | null;
}

export interface IEvent {
  gid: number;
  job_id: string;
  seq: number;
  type: 'status' | 'epoch' | 'batch' | 'log' | 'error' | 'artifact';
  ts: number;
  data: { [key: string]: any };
}

export interface IInstance {
  id: string;
  machine_id: string;
  provider: string;
  status: string;
  substatus: string;
  job_id: string | null;
  cooling_left_s: number;
}

export interface IMachine {
  machine_id: string;
  provider: string;
  gpu_type: string | null;
  gpu_count: number;
  vcpus: number;
  memory_gib: number;
  price_per_hour: number;
  on_demand_price_per_hour: number;
  availability: string;
}

/** A proxy answer that was not 2xx; `reconnecting` when the backend itself could not be reached. */
export class ApiError extends Error {
  constructor(
    message: string,
    readonly status: number
  ) {
    super(message);
  }
}

export async function requestAPI<T>(path: string, init: RequestInit = {}): Promise<T> {
  const settings = ServerConnection.makeSettings();
  const url = URLExt.join(settings.baseUrl, 'aibro', 'api', path);
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, init, settings);
  } catch (error) {
    throw new ApiError(`Jupyter server unreachable: ${String(error)}`, 0);
  }
  const text = await response.text();
  let body: any = {};
  try {
    body = text ? JSON.parse(text) : {};
  } catch {
    body = { error: text.slice(0, 300) };
  }
  if (!response.ok) {
    throw new ApiError(body.error ?? response.statusText, response.status);
  }
  return body as T;
}
