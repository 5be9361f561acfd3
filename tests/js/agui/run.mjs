// Runs one AG-UI run with the official client (@ag-ui/client's HttpAgent) and prints what it
// received as one JSON object on stdout: every event (in order, as the client parsed and
// verified it), the messages the client built (activity messages included), or the error.
//
//   node run.mjs <url> <threadId> <runId> [<header>=<value> ...]
import { HttpAgent } from "@ag-ui/client";

const [url, threadId, runId, ...headerArgs] = process.argv.slice(2);
const headers = Object.fromEntries(
  headerArgs.map((arg) => [arg.slice(0, arg.indexOf("=")), arg.slice(arg.indexOf("=") + 1)]),
);
const agent = new HttpAgent({ url, headers, threadId });
agent.messages = [{ id: "user-1", role: "user", content: "Where is order 42?" }];
const events = [];
let error = null;
try {
  await agent.runAgent(
    { runId },
    {
      onEvent({ event }) {
        events.push(event);
      },
    },
  );
} catch (exc) {
  error = String(exc && exc.message ? exc.message : exc);
}
process.stdout.write(JSON.stringify({ events, messages: agent.messages, error }) + "\n");
