// The document's text, split into its segments as their margins reveal them.
//
// The server's character offsets count Unicode code points (Python strings); JavaScript strings
// count UTF-16 units, so the text is held as an array of code points.

export class DocumentView {
  constructor(element) {
    this.element = element;
    this.chars = [];
    // Sorted, non-overlapping pieces covering the text: {start, end, node, segment}.
    this.pieces = [];
  }

  show(text) {
    this.chars = Array.from(text);
    const node = document.createTextNode(text);
    this.element.replaceChildren(node);
    this.pieces = [{ start: 0, end: this.chars.length, node, segment: null }];
  }

  slice(start, end) {
    return this.chars.slice(start, end).join("");
  }

  // The element of segment `index` (0-based) over [start, end), created on first sight.
  segment(index, start, end) {
    const known = this.element.querySelector(`#seg-${index}`);
    if (known) return known;
    const at = this.pieces.findIndex((p) => p.segment === null && p.start <= start && end <= p.end);
    if (at < 0) return null; // not within the text shown (another document)
    const piece = this.pieces[at];
    const span = document.createElement("span");
    span.id = `seg-${index}`;
    span.className = "segment";
    span.dataset.segment = String(index);
    span.dataset.label = `§${index + 1}`;
    span.textContent = this.slice(start, end);
    const replacement = [];
    if (piece.start < start) replacement.push(this.textPiece(piece.start, start));
    replacement.push({ start, end, node: span, segment: index });
    if (end < piece.end) replacement.push(this.textPiece(end, piece.end));
    piece.node.replaceWith(...replacement.map((p) => p.node));
    this.pieces.splice(at, 1, ...replacement);
    return span;
  }

  textPiece(start, end) {
    return { start, end, node: document.createTextNode(this.slice(start, end)), segment: null };
  }

  // Marks [start, end) of segment `index` as a margin's evidence (the sentences it snapped to).
  markEvidence(index, start, end) {
    const piece = this.pieces.find((p) => p.segment === index);
    if (!piece || !(piece.start <= start && start < end && end <= piece.end)) return;
    const mark = document.createElement("mark");
    mark.className = "evidence";
    mark.textContent = this.slice(start, end);
    piece.node.replaceChildren(this.slice(piece.start, start), mark, this.slice(end, piece.end));
  }

  clearMarks() {
    for (const piece of this.pieces) {
      if (piece.segment === null) continue;
      piece.node.classList.remove("kept", "dropped", "highlight");
      piece.node.replaceChildren(this.slice(piece.start, piece.end));
    }
  }

  highlight(index, on) {
    const span = this.element.querySelector(`#seg-${index}`);
    if (span) span.classList.toggle("highlight", on);
  }

  reveal(index) {
    const span = this.element.querySelector(`#seg-${index}`);
    if (!span) return;
    // Scroll the text panel only (it is the spans' offset parent), not the page around it.
    const top = span.offsetTop - 8;
    this.element.scrollTo({ top, behavior: "smooth" });
  }
}
