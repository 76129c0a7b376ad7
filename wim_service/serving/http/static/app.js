// The reading page: read a document into a session once, then ask about it, watching the
// margins arrive, the answer stream in, and what it cost.

import {
  ApiError,
  apiKey,
  closeDocument,
  openDocument,
  pdfText,
  setApiKey,
  streamEvents,
} from "./api.js";
import { DocumentView } from "./document-view.js";

const $ = (id) => document.getElementById(id);
const ui = {
  apiKey: $("api-key"),
  documentForm: $("document-form"),
  text: $("document-text"),
  file: $("document-file"),
  segmentTokens: $("segment-tokens"),
  readButton: $("read-button"),
  readingProgress: $("reading-progress"),
  documentStatus: $("document-status"),
  session: $("document-session"),
  closeButton: $("close-button"),
  askForm: $("ask-form"),
  question: $("question"),
  relevance: $("relevance"),
  askButton: $("ask-button"),
  cancelButton: $("cancel-button"),
  progress: $("progress"),
  progressText: $("progress-text"),
  answer: $("answer"),
  error: $("error"),
  stats: $("stats"),
  margins: $("margins"),
  history: $("history"),
};
const view = new DocumentView($("document-view"));

let current = null; // the open document session: {id, segments, tokens, replica}
let running = null; // the AbortController of the question being answered

const count = new Intl.NumberFormat();
const seconds = (s) => `${s.toFixed(2)} s`;

function element(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined) node.textContent = text;
  if (className) node.className = className;
  return node;
}

function describe(err) {
  return err instanceof ApiError
    ? `${err.message} (HTTP ${err.status}, ${err.code})`
    : String(err?.message || err);
}

function showError(message) {
  ui.error.textContent = message;
}

// -- API key ---------------------------------------------------------------------------------

ui.apiKey.value = apiKey();
ui.apiKey.addEventListener("input", () => setApiKey(ui.apiKey.value.trim()));

// -- the document ----------------------------------------------------------------------------

ui.file.addEventListener("change", async () => {
  const file = ui.file.files[0];
  if (!file) return;
  showError("");
  ui.documentStatus.textContent = `Opening ${file.name}…`;
  try {
    const pdf = file.type === "application/pdf" || /\.pdf$/i.test(file.name);
    const text = pdf ? (await pdfText(file)).text : await file.text();
    ui.text.value = text;
    ui.documentStatus.textContent = `${file.name}: ${count.format(text.length)} characters.`;
  } catch (err) {
    ui.documentStatus.textContent = "";
    showError(`Could not open ${file.name}: ${describe(err)}`);
  }
});

function setReading(on) {
  ui.readButton.disabled = on;
  ui.text.readOnly = on;
  ui.readingProgress.hidden = !on;
}

ui.documentForm.addEventListener("submit", async (event) => {
  event.preventDefault();
  const text = ui.text.value;
  if (!text.trim()) return;
  showError("");
  setReading(true);
  ui.documentStatus.textContent =
    `Reading ${count.format(text.length)} characters: each segment is prefilled once…`;
  const started = performance.now();
  try {
    const options = { segment_tokens: Number(ui.segmentTokens.value) || 512 };
    const opened = await openDocument(text, options);
    current = {
      id: opened.document_id,
      segments: opened.segments,
      tokens: opened.context_tokens,
      replica: opened.replica,
    };
    view.show(text);
    ui.documentStatus.textContent =
      `Read in ${seconds((performance.now() - started) / 1000)}: ` +
      `${count.format(opened.context_tokens)} tokens in ${opened.segments} segments ` +
      `(session ${opened.document_id}, replica ${opened.replica}). Ask as often as you like.`;
    enterSession();
  } catch (err) {
    ui.documentStatus.textContent = "";
    showError(`The document was not read: ${describe(err)}`);
  } finally {
    setReading(false);
  }
});

function enterSession() {
  document.body.classList.add("has-document");
  ui.documentForm.hidden = true;
  ui.session.hidden = false;
  ui.history.replaceChildren();
  resetAnswer();
  setAsking(false);
  ui.question.placeholder = "Your question about the document";
  ui.question.focus();
}

function leaveSession(message) {
  running?.abort();
  current = null;
  document.body.classList.remove("has-document");
  ui.documentForm.hidden = false;
  ui.session.hidden = true;
  setAsking(false);
  ui.question.placeholder = "Read a document first";
  ui.documentStatus.textContent = message;
}

ui.closeButton.addEventListener("click", async () => {
  const id = current?.id;
  leaveSession("Document closed: the server freed its KV cache.");
  ui.text.focus();
  try {
    if (id) await closeDocument(id);
  } catch (err) {
    if (!(err instanceof ApiError && err.status === 404)) showError(describe(err));
  }
});

// -- questions -------------------------------------------------------------------------------

function setAsking(on) {
  const open = current !== null;
  ui.question.disabled = !open;
  ui.question.readOnly = on;
  ui.relevance.disabled = !open || on;
  ui.askButton.disabled = !open || on;
  ui.cancelButton.disabled = !on;
  ui.answer.setAttribute("aria-busy", String(on));
}

function resetAnswer() {
  ui.answer.textContent = "";
  showError("");
  ui.stats.replaceChildren();
  ui.margins.replaceChildren();
  ui.progress.max = current?.segments || 1;
  ui.progress.value = 0;
  ui.progressText.textContent = "";
  view.clearMarks();
}

function showProgress(done) {
  ui.progress.value = done;
  ui.progressText.textContent = `${done} of ${current.segments} segments have their margin`;
}

// Why a margin stays out of the final prompt, in the order the service decides it.
function dropReason(margin) {
  if (margin.skipped) return "not written: no sentence here shares enough with the question";
  if (!margin.text) return "no note";
  if (margin.cut_short) return "cut short: it named what no sentence near the question says";
  if (!margin.relevant) return "judged not relevant";
  if (!margin.grounded) return "not found in its segment";
  return "too little in common with the question";
}

function addMargin(margin) {
  const label = `Segment ${margin.segment + 1}`;
  const state = margin.kept ? "kept" : "dropped";
  const item = element("li", undefined, `margin ${state}`);
  item.dataset.segment = String(margin.segment);
  const link = element("a", label, "segment-link");
  link.href = `#seg-${margin.segment}`;
  link.addEventListener("click", (event) => {
    event.preventDefault();
    view.reveal(margin.segment);
  });
  const note = element(
    "p",
    margin.text ||
      (margin.skipped
        ? "Not written: no sentence of this segment holds enough of the question's words for a note to be kept."
        : "No note: the model found nothing here about the question."),
    "note",
  );
  if (margin.kept) {
    const head = element("div", undefined, "margin-head");
    head.append(link, element("span", "kept", "badge"));
    item.append(head, note);
    if (margin.evidence) {
      // Snapped: the answer reads the document's own sentences, not the model's note.
      head.append(element("span", "grounded", "badge grounded"));
      const quote = element("blockquote", margin.evidence, "evidence");
      quote.title = "The document's words the answer reads for this margin";
      item.append(quote);
    }
  } else {
    const details = element("details");
    details.append(element("summary", `${label}: ${dropReason(margin)}`), note, link);
    item.append(details);
  }
  for (const [type, on] of [
    ["mouseenter", true],
    ["mouseleave", false],
    ["focusin", true],
    ["focusout", false],
  ]) {
    item.addEventListener(type, () => view.highlight(margin.segment, on));
  }
  const after = [...ui.margins.children].find((li) => Number(li.dataset.segment) > margin.segment);
  ui.margins.insertBefore(item, after ?? null);
  view.segment(margin.segment, margin.char_start, margin.char_end)?.classList.add(state);
  if (margin.kept && margin.evidence) {
    view.markEvidence(margin.segment, margin.evidence_start, margin.evidence_end);
  }
}

// Hovering a segment of the text points at its margin too.
view.element.addEventListener("mouseover", (event) => {
  const span = event.target.closest?.(".segment");
  for (const li of ui.margins.children) {
    li.classList.toggle("highlight", span !== null && li.dataset.segment === span?.dataset.segment);
  }
});
view.element.addEventListener("mouseleave", () => {
  for (const li of ui.margins.children) li.classList.remove("highlight");
});

function markNotes(done) {
  const used = new Set(done.notes || []);
  const leftOut = new Set(done.notes_dropped || []);
  for (const li of ui.margins.querySelectorAll(".margin.kept")) {
    const segment = Number(li.dataset.segment);
    const head = li.querySelector(".margin-head");
    if (used.has(segment)) {
      head.append(element("span", "in the answer's notes", "badge used"));
    } else if (leftOut.has(segment)) {
      head.append(element("span", "left out: no room in the window", "badge left-out"));
    }
  }
}

// Once the answer is in, bring the first kept margin's segment into the text's view.
function revealFirstKept() {
  const first = ui.margins.querySelector(".margin.kept");
  if (first) view.reveal(Number(first.dataset.segment));
}

function showStats(done, clock) {
  const u = done.usage;
  const t = done.timings;
  const rows = [
    ["Segments", count.format(u.segments)],
    ["Document tokens", count.format(u.context_tokens)],
    ["Prompt tokens", count.format(u.prompt_tokens_submitted)],
    ["… from the KV cache", count.format(u.prompt_tokens_cached)],
    ["… computed", count.format(u.prompt_tokens_computed)],
    ["Margin tokens", count.format(u.margin_tokens)],
    ["Answer tokens", count.format(u.answer_tokens)],
    ["First margin", clock.firstMargin ? seconds((clock.firstMargin - clock.started) / 1000) : "–"],
    ["First answer token", seconds(t.answer_ttft_s)],
    ["Total (server)", seconds(t.total_s)],
    ["Replica", done.replica || "–"],
  ];
  ui.stats.replaceChildren(
    ...rows.map(([name, value]) => {
      const group = element("div");
      group.append(element("dt", name), element("dd", value));
      return group;
    }),
  );
}

function addHistory(question, answer) {
  const item = element("li");
  item.append(element("p", question, "question"), element("p", answer || "(no answer)", "reply"));
  ui.history.prepend(item);
}

async function ask(question) {
  resetAnswer();
  const controller = new AbortController();
  running = controller;
  setAsking(true);
  const clock = { started: performance.now(), firstMargin: null };
  const seen = new Set();
  let finished = false;
  const body = {
    document_id: current.id,
    query: question,
    stream: true,
    options: { relevance: ui.relevance.value },
  };
  try {
    for await (const { type, data } of streamEvents("/wim", body, controller.signal)) {
      if (type === "margin") {
        clock.firstMargin ??= performance.now();
        seen.add(data.segment);
        addMargin(data);
        showProgress(seen.size);
      } else if (type === "answer") {
        ui.answer.textContent += data.text;
      } else if (type === "done") {
        finished = true;
        ui.answer.textContent = data.answer || "(no answer)";
        markNotes(data);
        showStats(data, clock);
        revealFirstKept();
        addHistory(question, data.answer);
      } else if (type === "error") {
        showError(`The job failed: ${data.message} (${data.code})`);
      }
    }
    if (!finished && !ui.error.textContent) showError("The answer stream ended early.");
  } catch (err) {
    if (err.name === "AbortError") {
      ui.progressText.textContent =
        `Cancelled after ${seen.size} of ${current?.segments ?? "?"} margins; ` +
        "the server stopped the job.";
    } else if (err instanceof ApiError && err.status === 404) {
      leaveSession("The document session expired or was closed: read the document again.");
    } else {
      showError(describe(err));
    }
  } finally {
    running = null;
    setAsking(false);
  }
}

ui.askForm.addEventListener("submit", (event) => {
  event.preventDefault();
  const question = ui.question.value.trim();
  if (question && current && !running) ask(question);
});
ui.cancelButton.addEventListener("click", () => running?.abort());
document.addEventListener("keydown", (event) => {
  if (event.key === "Escape" && running) running.abort();
});
