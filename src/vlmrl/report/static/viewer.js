// Rollout viewer: page through the logged steps and their groups (one prompt, its image, its G
// completions ranked best to worst). Data comes from the JSON block #rollout-data; every model or
// dataset string reaches the page through textContent, never as HTML. The position is kept in the
// address (report.html#step=40&group=2), so a link can point at one group.
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("rollout-data").textContent);
  var root = document.getElementById("viewer");
  if (!data.steps.length) {
    root.appendChild(el("p", "empty", "No rollouts were logged (train.log_rollouts_every)."));
    return;
  }
  var stepIndex = data.steps.length - 1; // the latest logged step first, unless the address names one
  var groupIndex = 0;
  var wanted = /step=(\d+)(?:&group=(\d+))?/.exec(location.hash);
  if (wanted) {
    data.steps.forEach(function (entry, index) { if (entry.step === Number(wanted[1])) stepIndex = index; });
    groupIndex = wanted[2] ? Number(wanted[2]) - 1 : 0;
  }

  function el(tag, className, text) {
    var node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined && text !== null) node.textContent = text;
    return node;
  }

  function fmt(value, digits) {
    return value === null || value === undefined ? "–" : value.toFixed(digits === undefined ? 2 : digits);
  }

  function signed(value) {
    return value === null || value === undefined ? "–" : (value > 0 ? "+" : "") + value.toFixed(2);
  }

  function button(label, title, onClick) {
    var node = el("button", "", label);
    node.type = "button";
    node.title = title;
    node.addEventListener("click", onClick);
    return node;
  }

  // Controls: step picker, previous/next step and group, position, a strip of groups by reward.
  var controls = el("div", "controls");
  var select = el("select");
  select.setAttribute("aria-label", "logged step");
  data.steps.forEach(function (entry, index) {
    var option = el("option", "", "step " + entry.step);
    option.value = String(index);
    select.appendChild(option);
  });
  select.addEventListener("change", function () { go(Number(select.value), 0); });
  var position = el("span", "position");
  controls.appendChild(button("◀", "previous step (Shift+←)", function () { go(stepIndex - 1, 0); }));
  controls.appendChild(select);
  controls.appendChild(button("▶", "next step (Shift+→)", function () { go(stepIndex + 1, 0); }));
  controls.appendChild(button("‹ group", "previous group (←)", function () { go(stepIndex, groupIndex - 1); }));
  controls.appendChild(button("group ›", "next group (→)", function () { go(stepIndex, groupIndex + 1); }));
  controls.appendChild(position);
  controls.appendChild(el("span", "keys", "← → groups · Shift+← → steps"));
  var strip = el("div", "strip");
  var body = el("div");
  root.appendChild(controls);
  root.appendChild(strip);
  root.appendChild(body);

  function go(step, group) {
    stepIndex = Math.max(0, Math.min(data.steps.length - 1, step));
    var groups = data.steps[stepIndex].groups;
    groupIndex = Math.max(0, Math.min(groups.length - 1, group));
    render();
  }

  // Mean total reward of a group, as a colour from red (lowest of the step) to green (highest).
  function shade(mean, lo, hi) {
    if (mean === null) return "#dddddd";
    var t = hi > lo ? (mean - lo) / (hi - lo) : 0.5;
    return "hsl(" + Math.round(t * 120) + ", 55%, " + (78 - 18 * t) + "%)";
  }

  function renderStrip(entry) {
    strip.textContent = "";
    var means = entry.groups.map(function (g) { return g.mean; }).filter(function (m) { return m !== null; });
    var lo = Math.min.apply(null, means), hi = Math.max.apply(null, means);
    entry.groups.forEach(function (group, index) {
      var cell = button("", "group " + (index + 1) + ": mean reward " + fmt(group.mean) +
                        (group.signal ? "" : " (all rewards equal)"), function () { go(stepIndex, index); });
      cell.style.background = shade(group.mean, lo, hi);
      if (index === groupIndex) cell.className = "current";
      strip.appendChild(cell);
    });
  }

  function renderCompletion(completion, rank) {
    var item = el("li", "completion " + completion.mark);
    var meta = el("div", "meta");
    meta.appendChild(el("span", "", "#" + rank));
    if (completion.mark) meta.appendChild(el("span", "badge " + completion.mark, completion.mark));
    meta.appendChild(el("span", "total", "total " + fmt(completion.rewards.total)));
    var advantage = completion.advantage;
    meta.appendChild(el("span", "adv " + (advantage > 0 ? "pos" : advantage < 0 ? "neg" : ""),
                        "advantage " + signed(advantage)));
    Object.keys(completion.rewards).forEach(function (name) {
      if (name !== "total") meta.appendChild(el("span", "", name + " " + fmt(completion.rewards[name])));
    });
    if (completion.length !== null) meta.appendChild(el("span", "", completion.length + " tokens"));
    if (completion.truncated) meta.appendChild(el("span", "badge truncated", "truncated"));
    item.appendChild(meta);
    if (completion.turns && completion.turns.length) {  // a trajectory with tools: every turn, images inline
      completion.turns.forEach(function (turn) {
        var box = el("div", "turn " + turn.role);
        box.appendChild(el("span", "badge", turn.role));
        box.appendChild(el("pre", "", turn.text));
        (turn.images || []).forEach(function (name) {
          if (data.images[name]) { var image = el("img"); image.src = data.images[name]; image.alt = name; box.appendChild(image); }
        });
        item.appendChild(box);
      });
    } else {
      item.appendChild(el("pre", "", completion.text));
    }
    return item;
  }

  function render() {
    var entry = data.steps[stepIndex];
    var group = entry.groups[groupIndex];
    select.value = String(stepIndex);
    history.replaceState(null, "", "#step=" + entry.step + "&group=" + (groupIndex + 1));
    var shown = entry.groups.length < entry.groups_total ? " (first " + entry.groups.length + " shown)" : "";
    position.textContent = "group " + (groupIndex + 1) + " of " + entry.groups_total + shown;
    renderStrip(entry);
    body.textContent = "";
    if (!group) { body.appendChild(el("p", "empty", "This step logged no completions.")); return; }

    var card = el("div", "group");
    var side = el("div", "side");
    var names = group.image_names && group.image_names.length ? group.image_names : [group.image_name];
    names.forEach(function (name) {  // every image of the prompt, in order
      if (name && data.images[name]) {
        var image = el("img");
        image.src = data.images[name];
        image.alt = name;
        side.appendChild(image);
      } else {
        side.appendChild(el("div", "noimage", name ? "image not found: " + name : "no image logged"));
      }
    });
    var facts = el("dl");
    [["from", group.source || "not logged", ""], ["prompt", group.prompt, ""], ["answer", group.answer, "answer"],
     ["group", "mean reward " + fmt(group.mean) + " over " + group.completions.length + " completions", ""]]
      .forEach(function (fact) {
        facts.appendChild(el("dt", "", fact[0]));
        facts.appendChild(el("dd", fact[2], fact[1]));
      });
    side.appendChild(facts);

    var column = el("div");
    if (!group.signal) column.appendChild(el("p", "nosignal", "All completions got the same reward: this group carries no learning signal."));
    var list = el("ol", "completions");
    group.completions.forEach(function (completion, index) { list.appendChild(renderCompletion(completion, index + 1)); });
    column.appendChild(list);
    card.appendChild(side);
    card.appendChild(column);
    body.appendChild(card);
  }

  document.addEventListener("keydown", function (event) {
    var target = event.target.tagName;
    if (target === "SELECT" || target === "INPUT" || target === "TEXTAREA") return;
    var delta = event.key === "ArrowLeft" ? -1 : event.key === "ArrowRight" ? 1 : 0;
    if (!delta) return;
    event.preventDefault();
    if (event.shiftKey) go(stepIndex + delta, 0); else go(stepIndex, groupIndex + delta);
  });

  go(stepIndex, groupIndex);
})();
