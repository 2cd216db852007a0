// The integration suite over transport "ws".

import { defineSuite } from "./suite.js";

defineSuite("ws");
