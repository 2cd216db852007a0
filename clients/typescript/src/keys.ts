// A message's ordering key, as the consumer's `ordering_key` spec names it (`subject:<n>`,
// `header:<Name>`, `header`): the worker starts a key's next message only once the one before
// it was settled, so local concurrency never undoes the gateway's order.

import type { Message } from "./message.js";

/** Keys longer than this count as none, as at the gateway. */
const MAX_KEY = 1024;
const DEFAULT_HEADER = "Ruststream-Ordering-Key";

export type KeyOf = (message: Message) => string | undefined;

/** The key function of a spec; without one (consumer info unreadable), the header POST /publish writes. */
export function keyFunction(spec: string | null | undefined): KeyOf {
  let read: KeyOf;
  if (spec != null && spec.startsWith("subject:")) {
    const index = Number(spec.slice("subject:".length)) - 1;
    read = (message) => message.subject.split(".")[index];
  } else if (spec != null && spec.startsWith("header:")) {
    const name = spec.slice("header:".length);
    read = (message) => message.header(name);
  } else {
    read = (message) => (hasHeaders(message) ? message.header(DEFAULT_HEADER) : undefined);
  }
  return (message) => {
    const key = read(message);
    return key === undefined || key === "" || key.length > MAX_KEY ? undefined : key;
  };
}

function hasHeaders(message: Message): boolean {
  for (const _ in message.headers) return true;
  return false;
}
