/**
 * labextension/openapi.json (the backend's OpenAPI document) -> labextension/src/generated/openapi.ts, the types
 * api.ts reads every answer with. Run by `jlpm build:types`, after dump_openapi.py; tests pass other paths:
 * `node openapi_types.mjs [DOCUMENT TARGET]`.
 *
 * One change on the way: a response model with declared properties and `additionalProperties: true` ("fields may
 * be added later") is closed. As a TypeScript index signature it would let `answer.anything` compile, so reading a
 * field the backend does not send would not fail the build; a closed type still accepts extra fields at run time.
 * Objects with no declared properties (free-form maps such as an event's data) keep their index signature.
 */
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

import openapiTS, { astToString, COMMENT_HEADER } from 'openapi-typescript';

const here = path.dirname(fileURLToPath(import.meta.url));
const [source, target] =
  process.argv.length > 3
    ? process.argv.slice(2, 4)
    : [path.join(here, '..', 'openapi.json'), path.join(here, '..', 'src', 'generated', 'openapi.ts')];

function close(node) {
  if (Array.isArray(node)) {
    node.forEach(close);
  } else if (node && typeof node === 'object') {
    if (node.properties && node.additionalProperties === true) {
      delete node.additionalProperties;
    }
    Object.values(node).forEach(close);
  }
}

const doc = JSON.parse(fs.readFileSync(source, 'utf8'));
close(doc);
const ast = await openapiTS(doc, { enumValues: true });
const text = COMMENT_HEADER.replace(
  ' */',
  ' * From labextension/openapi.json by labextension/scripts/openapi_types.mjs (`jlpm build:types`).\n */'
);
fs.mkdirSync(path.dirname(target), { recursive: true });
fs.writeFileSync(target, text + astToString(ast));
console.log(`openapi_types: wrote ${path.relative(process.cwd(), target)}`);
