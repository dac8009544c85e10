/**
 * The statuses the backend sends (aibro_core/vocabulary.py), by name: each map is made from the generated OpenAPI
 * document's values, so nothing here lists them again and a status the backend renames fails the build where it
 * is used.
 */
import type { IInstance, IJob, IStudy } from './api';
import {
  instanceStatusValues,
  jobStatusValues,
  studyStatusValues,
  studyTrialStatusValues
} from './generated/openapi';

/** Every member of the union `T`, by its own name. */
type Named<T extends string> = { readonly [K in T]: K };

function named<T extends string>(values: readonly T[]): Named<T> {
  const byName: Record<string, string> = {};
  values.forEach(value => (byName[value] = value));
  return Object.freeze(byName) as Named<T>;
}

export type JobStatus = IJob['status'];
export type JobSubstatus = IJob['substatus'];
export type StudyStatus = IStudy['status'];
export type TrialStatus = IStudy['trials'][number]['status'];
export type InstanceStatus = IInstance['status'];

export const JobStatus = named<JobStatus>(jobStatusValues);
export const StudyStatus = named<StudyStatus>(studyStatusValues);
export const TrialStatus = named<TrialStatus>(studyTrialStatusValues);
export const InstanceStatus = named<InstanceStatus>(instanceStatusValues);

/** How a CLOSING or CLOSED instance went away (vocabulary.InstanceEnding; the document types an instance's
 * substatus as any string, so these are named here). */
export const InstanceEnding = {
  STOPPING: 'STOPPING',
  STOPPED: 'STOPPED',
  TERMINATING: 'TERMINATING',
  TERMINATED: 'TERMINATED'
} as const;
