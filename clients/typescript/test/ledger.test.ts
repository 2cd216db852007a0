// The ledger test (ledger.ts) over the transports it covers.

import { defineLedger } from "./ledger.js";

defineLedger("ws");
defineLedger("sse");
defineLedger("fetch");
