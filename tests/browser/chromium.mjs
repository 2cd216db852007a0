// Debian's headless Chromium as the browser checks start it (playwright-core, which
// downloads no browser): CHROMIUM_BIN or /usr/bin/chromium, a persistent profile in the
// folder given.
import { chromium } from "playwright-core";

export const executablePath = process.env.CHROMIUM_BIN || "/usr/bin/chromium";

// --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start. The network flags
// keep Chromium from calling home (the machine's network is closed: each attempt is refused).
export const launch = (profileDir, options = {}) =>
    chromium.launchPersistentContext(profileDir, {
        executablePath,
        headless: true,
        args: [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
        ],
        ...options,
    });
