/**
 * The labextension's only way out: `/aibro/api/*` on the Jupyter server, which holds the backend's token.
 *
 * Every answer is typed from the backend's OpenAPI document: `generated/openapi.ts` is made from it by
 * `jlpm build:types` before each build, so reading a field the backend does not send, or a route it does not
 * have, fails the build.
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

import type { paths } from './generated/openapi';

type Method = 'get' | 'post';
type Operation<P extends keyof paths, M extends Method> = NonNullable<paths[P][M]>;
/** The routes of the document that take `method`. */
type Route<M extends Method> = {
  [P in keyof paths]: paths[P][M] extends { responses: unknown } ? P : never;
}[keyof paths];
type Parameters<P extends keyof paths, M extends Method> = Operation<P, M>['parameters'];
/** What a route's `{name}` placeholders take (`undefined` for a route with none). */
type PathParams<P extends keyof paths, M extends Method> = Parameters<P, M>['path'];
type QueryParams<P extends keyof paths, M extends Method> = Parameters<P, M>['query'];

/** The JSON body a route answers 200 with, as the document declares it. */
export type Answer<P extends keyof paths, M extends Method = 'get'> =
  Operation<P, M> extends { responses: { 200: { content: { 'application/json': infer B } } } } ? B : never;

export type IJob = Answer<'/jobs/{job_id}'>;
export type IEvent = Answer<'/events'>['events'][number];
export type IInstance = Answer<'/instances'>['instances'][number];
export type IMachine = Answer<'/machines'>['machines'][number];
export type IStudy = Answer<'/studies/{study_id}'>;
/** One epoch of a job's history: `epoch` (from 1) and every Keras log of it (null where it was not finite). */
export type HistoryRow = IJob['history'][number];
export type TimelineEntry = IJob['timeline'][number];

/** A proxy answer that was not 2xx (status 0: the Jupyter server itself could not be reached). */
export class ApiError extends Error {
  constructor(
    message: string,
    readonly status: number
  ) {
    super(message);
  }
}

/** The calls the sidebar makes, each typed by its route in the document. All throw `ApiError`. */
export const api = {
  jobs: () => call('get', '/jobs', undefined),
  machines: () => call('get', '/machines', undefined),
  instances: () => call('get', '/instances', undefined),
  studies: () => call('get', '/studies', undefined),
  /** The study as it is once cancelled: no more trials start, its running trials' jobs are cancelled. */
  cancelStudy: (studyId: string) => call('post', '/studies/{study_id}/cancel', { study_id: studyId }),
  /** The user's events after `after`, waiting up to `wait` seconds for one. */
  events: (after: number, wait: number) => call('get', '/events', undefined, { after, wait }),
  /** The job as it is once the cancel is recorded (`cancel_requested`); the worker stops within a batch. */
  cancel: (jobId: string) => call('post', '/jobs/{job_id}/cancel', { job_id: jobId }),
  /** `{instance}`: the instance as it is once it is closing. */
  terminate: (instanceId: string) =>
    call('post', '/instances/{instance_id}/terminate', { instance_id: instanceId })
};

async function call<M extends Method, P extends Route<M>>(
  method: M,
  route: P,
  path: PathParams<P, M>,
  query?: QueryParams<P, M>
): Promise<Answer<P, M>> {
  const fill = (path ?? {}) as Record<string, string>;
  const where = route.replace(/\{(\w+)\}/g, (_, name: string) => encodeURIComponent(fill[name]));
  const search = new URLSearchParams();
  Object.entries((query ?? {}) as Record<string, unknown>).forEach(([k, v]) => {
    if (v !== undefined && v !== null) {
      search.set(k, String(v));
    }
  });
  const qs = search.toString();
  return (await request(where.slice(1) + (qs ? `?${qs}` : ''), method.toUpperCase())) as Answer<P, M>;
}

async function request(path: string, method: string): Promise<unknown> {
  const settings = ServerConnection.makeSettings();
  const url = URLExt.join(settings.baseUrl, 'aibro', 'api', path);
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, { method }, settings);
  } catch (error) {
    throw new ApiError(`Jupyter server unreachable: ${String(error)}`, 0);
  }
  const text = await response.text();
  let body: unknown;
  try {
    body = text ? JSON.parse(text) : {};
  } catch {
    body = { error: text.slice(0, 300) };
  }
  if (!response.ok) {
    const error = (body as { error?: unknown } | null)?.error;
    throw new ApiError(typeof error === 'string' ? error : response.statusText, response.status);
  }
  return body;
}
