// Model output as a little markdown, built as DOM nodes from text only: no string of the
// model's ever becomes HTML, so `<script>` in an answer is shown, never run.
// Handled: ``` code blocks (with a copy button), `inline code`, **bold**, line breaks.

function inline(parent, text) {
  // Split on `code` and **bold**; everything else is a text node.
  const pattern = /(`[^`\n]+`|\*\*[^*\n]+\*\*)/g;
  let last = 0;
  for (const match of text.matchAll(pattern)) {
    if (match.index > last) parent.append(document.createTextNode(text.slice(last, match.index)));
    const token = match[0];
    const node = document.createElement(token.startsWith("`") ? "code" : "strong");
    node.textContent = token.startsWith("`") ? token.slice(1, -1) : token.slice(2, -2);
    parent.append(node);
    last = match.index + token.length;
  }
  if (last < text.length) parent.append(document.createTextNode(text.slice(last)));
}

export function copyButton(getText) {
  const button = document.createElement("button");
  button.className = "copy";
  button.type = "button";
  button.textContent = "copy";
  button.addEventListener("click", async () => {
    await navigator.clipboard.writeText(getText());
    button.textContent = "copied";
    setTimeout(() => (button.textContent = "copy"), 1200);
  });
  return button;
}

export function render(container, text) {
  container.replaceChildren();
  const parts = text.split(/```/);
  parts.forEach((part, i) => {
    if (i % 2 === 1) {
      // A code block: an optional language on its first line.
      const newline = part.indexOf("\n");
      const code = newline >= 0 ? part.slice(newline + 1) : part;
      const pre = document.createElement("pre");
      const element = document.createElement("code");
      element.textContent = code.replace(/\n$/, "");
      pre.append(element, copyButton(() => element.textContent));
      container.append(pre);
      return;
    }
    part.split(/\n{2,}/).forEach((paragraph) => {
      if (!paragraph.trim()) return;
      const p = document.createElement("p");
      paragraph.split("\n").forEach((line, j) => {
        if (j) p.append(document.createElement("br"));
        inline(p, line);
      });
      container.append(p);
    });
  });
}
