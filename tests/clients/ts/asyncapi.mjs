// scripts/ecosystem.sh: openapi/asyncapi.yaml read by the AsyncAPI parser (@asyncapi/parser,
// which validates against the AsyncAPI 3.0 schema and its rules): any error fails the check.
import { readFileSync } from "node:fs";
import { Parser } from "@asyncapi/parser";

const path = process.argv[2];
const { document, diagnostics } = await new Parser().parse(readFileSync(path, "utf8"));
const severities = ["error", "warning", "information", "hint"];
for (const diagnostic of diagnostics) {
  console.log(`${severities[diagnostic.severity]}: ${diagnostic.message} (at ${diagnostic.path.join(".")})`);
}
const errors = diagnostics.filter((diagnostic) => diagnostic.severity === 0);
if (!document || errors.length > 0) {
  console.error(`asyncapi: ${path}: ${errors.length} error(s)`);
  process.exit(1);
}
console.log(
  `asyncapi: ${path} is a valid AsyncAPI ${document.version()} document: ` +
    `${document.channels().length} channels, ${document.operations().length} operations, ` +
    `${document.messages().length} messages`,
);
