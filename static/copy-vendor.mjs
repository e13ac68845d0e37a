// Copy the browser builds of our npm dependencies into static/vendor (gitignored).
// Run by `npm ci` (postinstall) or explicitly with `npm run vendor`.
import { copyFileSync, mkdirSync, existsSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const root = join(dirname(fileURLToPath(import.meta.url)), "..");
const out = join(root, "static", "vendor");
const files = [
  ["node_modules/htmx.org/dist/htmx.min.js", "htmx.min.js"],
  ["node_modules/htmx-ext-sse/dist/sse.min.js", "htmx-ext-sse.min.js"],
  ["node_modules/chart.js/dist/chart.umd.min.js", "chart.umd.min.js"],
  // Swagger UI for /api/docs (served from here, so the docs work offline)
  ["node_modules/swagger-ui-dist/swagger-ui-bundle.js", "swagger-ui-bundle.js"],
  ["node_modules/swagger-ui-dist/swagger-ui.css", "swagger-ui.css"],
  ["node_modules/swagger-ui-dist/favicon-32x32.png", "swagger-ui-favicon.png"],
];
mkdirSync(out, { recursive: true });
for (const [src, name] of files) {
  const from = join(root, src);
  if (!existsSync(from)) {
    console.error(`missing ${src}; run npm ci first`);
    process.exit(1);
  }
  copyFileSync(from, join(out, name));
  console.log(`static/vendor/${name}`);
}
