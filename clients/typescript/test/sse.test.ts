// The integration suite over transport "sse".

import { defineSuite } from "./suite.js";

defineSuite("sse");
