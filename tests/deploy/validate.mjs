// Validates Kubernetes objects against the Kubernetes OpenAPI schemas with
// the npm package kubernetes-models, offline. Reads a JSON array of objects
// from the file named by argv[2]; prints one line per object; exits 1 if any
// object is invalid or of a kind it cannot check.
//
// Two checks per object:
// - the schema (kubernetes-models' validate(): types, enums, required
//   fields, formats);
// - unknown fields, which validate() lets through (its schemas allow extra
//   properties) but an API server with strict field validation, kubectl's
//   default, refuses: a misspelt `readOnlyRootFilesytem` would otherwise
//   pass here and fail at `kubectl apply`, or worse, be dropped where
//   validation is off. The field names come from the package's own type
//   declarations (.d.ts), read with the small parser below; a construct it
//   does not know fails the check rather than passing it.
import { readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const modules = join(here, "node_modules");

// ---- the type declarations ----

// A type: {kind: "object", props: Map, index: type|null} | {kind: "array", of}
// | {kind: "union", of: [...]} | {kind: "ref", name, file} | {kind: "leaf"}.
const declarations = new Map();  // .d.ts path -> {type, imports}

function tokenize(text) {
  const tokens = [];
  const re = /\s+|"(?:[^"\\]|\\.)*"|[A-Za-z_$][\w$]*|-?\d+(?:\.\d+)?|\[|\]|\{|\}|<|>|\||\?|:|;|,|\(|\)|=|\.|'(?:[^'\\]|\\.)*'/y;
  let m;
  while (re.lastIndex < text.length) {
    const at = re.lastIndex;
    if ((m = re.exec(text)) === null) throw new Error(`cannot tokenize at ${JSON.stringify(text.slice(at, at + 40))}`);
    if (!/^\s+$/.test(m[0])) tokens.push(m[0]);
  }
  return tokens;
}

function parseType(tokens, pos, file) {
  const alternatives = [];
  for (;;) {
    let t;
    [t, pos] = parsePrimary(tokens, pos, file);
    alternatives.push(t);
    if (tokens[pos] !== "|") break;
    pos++;
  }
  return [alternatives.length === 1 ? alternatives[0] : { kind: "union", of: alternatives }, pos];
}

function parsePrimary(tokens, pos, file) {
  const tok = tokens[pos];
  if (tok === "{") return parseObject(tokens, pos, file);
  if (tok === "Array" && tokens[pos + 1] === "<") {
    const [of, next] = parseType(tokens, pos + 2, file);
    if (tokens[next] !== ">") throw new Error(`${file}: expected > at token ${next}`);
    return [{ kind: "array", of }, next + 1];
  }
  if (/^["'-\d]/.test(tok) || ["string", "number", "boolean", "null", "any", "unknown", "true", "false"].includes(tok)) {
    return [{ kind: "leaf" }, pos + 1];
  }
  if (/^[A-Za-z_$][\w$]*$/.test(tok)) {
    if (tokens[pos + 1] === "[") throw new Error(`${file}: indexed type ${tok}[...] is not understood`);
    return [{ kind: "ref", name: tok, file }, pos + 1];
  }
  throw new Error(`${file}: unexpected token ${tok}`);
}

function parseObject(tokens, pos, file) {
  const props = new Map();
  let index = null;
  pos++;  // {
  while (tokens[pos] !== "}") {
    if (tokens[pos] === "[") {  // [key: string]: T;
      if (tokens[pos + 2] !== ":" || tokens[pos + 3] !== "string" || tokens[pos + 4] !== "]" || tokens[pos + 5] !== ":") {
        throw new Error(`${file}: index signature not understood`);
      }
      [index, pos] = parseType(tokens, pos + 6, file);
    } else {
      const name = tokens[pos].startsWith('"') ? JSON.parse(tokens[pos]) : tokens[pos];
      pos++;
      if (tokens[pos] === "?") pos++;
      if (tokens[pos] !== ":") throw new Error(`${file}: expected : after ${name}`);
      let t;
      [t, pos] = parseType(tokens, pos + 1, file);
      props.set(name, t);
    }
    if (tokens[pos] === ";" || tokens[pos] === ",") pos++;
  }
  return [{ kind: "object", props, index }, pos + 1];
}

function strip(text) {
  return text.replace(/\/\*[\s\S]*?\*\//g, "").replace(/\/\/[^\n]*/g, "");
}

function declarationOf(file) {
  if (declarations.has(file)) return declarations.get(file);
  const text = strip(readFileSync(file, "utf8"));
  const imports = new Map();
  for (const m of text.matchAll(/import\s*\{([^}]*)\}\s*from\s*"([^"]+)"/g)) {
    for (const name of m[1].split(",").map((s) => s.trim()).filter(Boolean)) {
      imports.set(name.split(/\s+as\s+/).pop(), m[2]);
    }
  }
  let type;
  const iface = /export interface (\w+)(?:\s+extends\s+[\w,\s]+)?\s*\{/.exec(text);
  const alias = /export type (\w+)\s*=\s*/.exec(text);
  if (iface && (!alias || iface.index < alias.index)) {
    const tokens = tokenize(text.slice(iface.index + iface[0].length - 1));
    [type] = parseObject(tokens, 0, file);
  } else if (alias) {
    const body = text.slice(alias.index + alias[0].length, text.indexOf(";", alias.index));
    [type] = parseType(tokenize(body), 0, file);
  } else {
    throw new Error(`${file}: no interface or type declared`);
  }
  const entry = { type, imports };
  declarations.set(file, entry);
  return entry;
}

function resolveFile(specifier, from) {
  const base = specifier.startsWith(".") ? join(dirname(from), specifier) : join(modules, specifier);
  return base.replace(/\.js$/, "") + ".d.ts";
}

function resolve(ref) {
  const { imports } = declarationOf(ref.file);
  const specifier = imports.get(ref.name);
  if (specifier === undefined) {
    // The file's own interface (a self-reference, as in JSONSchemaProps).
    return declarationOf(ref.file).type;
  }
  if (specifier.startsWith("@kubernetes-models/base")) return { kind: "leaf" };
  return declarationOf(resolveFile(specifier, ref.file)).type;
}

// Every field of `value` that `type` does not declare, as a path.
function unknownFields(value, type, path, out) {
  if (type.kind === "ref") return unknownFields(value, resolve(type), path, out);
  if (value === null || typeof value !== "object") return out;
  if (type.kind === "union") {
    const want = Array.isArray(value) ? "array" : "object";
    for (const alt of type.of) {
      const t = alt.kind === "ref" ? resolve(alt) : alt;
      if (t.kind === want) return unknownFields(value, t, path, out);
    }
    return out;
  }
  if (type.kind === "array") {
    if (Array.isArray(value)) value.forEach((v, i) => unknownFields(v, type.of, `${path}/${i}`, out));
    return out;
  }
  if (type.kind === "object" && !Array.isArray(value)) {
    for (const [key, v] of Object.entries(value)) {
      const t = type.props.get(key) ?? type.index;
      if (t === null || t === undefined) {
        out.push(`${path}/${key}`);
      } else {
        unknownFields(v, t, `${path}/${key}`, out);
      }
    }
  }
  return out;
}

// ---- the objects ----

const objects = JSON.parse(readFileSync(process.argv[2], "utf8"));
let failed = 0;
for (const obj of objects) {
  const what = `${obj.kind ?? "?"}/${obj.metadata?.name ?? "?"}`;
  try {
    // "apps/v1" -> kubernetes-models/apps/v1; the core group's "v1" -> kubernetes-models/v1.
    const module = await import(`kubernetes-models/${obj.apiVersion}`);
    const Model = module[obj.kind];
    if (typeof Model !== "function") throw new Error(`no schema for ${obj.apiVersion} ${obj.kind}`);
    new Model(obj).validate();
    const declared = join(modules, "kubernetes-models", ...obj.apiVersion.split("/"), `${obj.kind}.d.ts`);
    const unknown = unknownFields(obj, declarationOf(declared).type, "", []);
    if (unknown.length > 0) throw new Error(`unknown fields: ${unknown.join(", ")}`);
    console.log(`valid   ${what}`);
  } catch (e) {
    failed++;
    console.log(`INVALID ${what}: ${e.message.split("\n").slice(0, 6).join(" | ")}`);
  }
}
process.exit(failed ? 1 : 0);
