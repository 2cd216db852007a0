// The integration suite over transport "fetch".

import { defineSuite } from "./suite.js";

defineSuite("fetch");
