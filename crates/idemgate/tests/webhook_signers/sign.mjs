// Signs a GitHub delivery with @octokit/webhooks-methods, for tests/webhooks.rs.
// Usage: node sign.mjs <dir holding node_modules> ; stdin: {"secret", "body"} ; stdout: sha256=<hex>
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const pkgDir = join(process.argv[2], "node_modules", "@octokit", "webhooks-methods");
const pkg = JSON.parse(readFileSync(join(pkgDir, "package.json"), "utf8"));
// The package is ESM with an exports map; resolve its Node entry by hand, since the SDK lives
// outside this script's directory tree.
const root = pkg.exports?.["."];
const entry = root?.node?.import ?? root?.default?.import ?? pkg.main;
const { sign, verify } = await import(pathToFileURL(join(pkgDir, entry)).href);

const req = JSON.parse(readFileSync(0, "utf8"));
const signature = await sign(req.secret, req.body);
if (!(await verify(req.secret, req.body, signature))) {
  throw new Error("the SDK does not verify its own signature");
}
process.stdout.write(signature);
