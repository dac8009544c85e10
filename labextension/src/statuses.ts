/**
 * The statuses the backend sends (aibro_core/vocabulary.py), named once for the TypeScript: each map is typed from
 * the OpenAPI document, so a status the backend adds, drops or renames fails the build here.
 */
import type { IInstance, IJob, IStudy } from './api';

/** Every member of the union `T`, by its own name. */
type Named<T extends string> = { readonly [K in T]: K };

export type JobStatus = IJob['status'];
export type JobSubstatus = IJob['substatus'];
export type StudyStatus = IStudy['status'];
export type TrialStatus = IStudy['trials'][number]['status'];
export type InstanceStatus = IInstance['status'];

export const JobStatus: Named<JobStatus> = {
  QUEUING: 'QUEUING',
  TRAINING: 'TRAINING',
  COMPLETED: 'COMPLETED',
  CANCELED: 'CANCELED'
};

export const StudyStatus: Named<StudyStatus> = {
  RUNNING: 'RUNNING',
  COMPLETED: 'COMPLETED',
  CANCELED: 'CANCELED',
  FAILED: 'FAILED'
};

export const TrialStatus: Named<TrialStatus> = {
  RUNNING: 'RUNNING',
  COMPLETED: 'COMPLETED',
  FAILED: 'FAILED',
  CANCELED: 'CANCELED'
};

export const InstanceStatus: Named<InstanceStatus> = {
  LAUNCHING: 'LAUNCHING',
  EXECUTING: 'EXECUTING',
  COOLING: 'COOLING',
  CLOSING: 'CLOSING',
  CLOSED: 'CLOSED'
};

/** How a CLOSING or CLOSED instance went away (vocabulary.InstanceEnding; the document types a substatus as any
 * string). */
export const InstanceEnding = {
  STOPPING: 'STOPPING',
  STOPPED: 'STOPPED',
  TERMINATING: 'TERMINATING',
  TERMINATED: 'TERMINATED'
} as const;
