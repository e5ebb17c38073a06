// Validates Kubernetes objects against the Kubernetes OpenAPI schemas with
// the npm package kubernetes-models, offline. Reads a JSON array of objects
// from the file named by argv[2]; prints one line per object; exits 1 if any
// object is invalid or of a kind it cannot check.
import { readFileSync } from "node:fs";

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
    console.log(`valid   ${what}`);
  } catch (e) {
    failed++;
    console.log(`INVALID ${what}: ${e.message.split("\n").slice(0, 6).join(" | ")}`);
  }
}
process.exit(failed ? 1 : 0);
