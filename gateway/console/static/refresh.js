// The console's one script: the live refresh. Every element with data-refresh="URL"
// has its contents replaced by that URL's fragment every few seconds, so a key another
// operator took shows up held, by whom, without a reload. Everything else on the
// console is links and plain form posts, and works with this script off.
(function () {
  "use strict";
  var PERIOD_MS = 3000;

  function say(text) {
    var note = document.getElementById("refresh-note");
    if (note) {
      note.textContent = text;
    }
  }

  function refresh(element) {
    if (document.hidden) {
      window.setTimeout(refresh, PERIOD_MS, element);
      return;
    }
    fetch(element.getAttribute("data-refresh"), {
      credentials: "same-origin",
      cache: "no-store",
      redirect: "error",
      headers: { Accept: "text/html" },
    })
      .then(function (response) {
        if (response.status === 401) {
          // Signed out (expired, or removed from the operators): stop, and say so.
          element.setAttribute("data-refresh-stopped", "signed out");
          say("Signed out: live refresh stopped. Reload the page to sign in again.");
          return null;
        }
        if (response.status !== 200) {
          throw new Error("HTTP " + response.status);
        }
        return response.text();
      })
      .then(function (html) {
        if (html === null) {
          return;
        }
        // Parsed as an inert document: nothing in it runs, and the server escaped it.
        var parsed = new DOMParser().parseFromString(html, "text/html");
        element.replaceChildren.apply(element, Array.prototype.slice.call(parsed.body.childNodes));
        element.setAttribute("data-refreshed", String(Date.now()));
        say("");
        window.setTimeout(refresh, PERIOD_MS, element);
      })
      .catch(function (error) {
        // The admin listener restarting, a network blip: keep the last rows, say so, retry.
        say("Live refresh failed (" + (error.message || "unreachable") + "); retrying.");
        window.setTimeout(refresh, PERIOD_MS, element);
      });
  }

  document.addEventListener("DOMContentLoaded", function () {
    var elements = document.querySelectorAll("[data-refresh]");
    for (var i = 0; i < elements.length; i += 1) {
      window.setTimeout(refresh, PERIOD_MS, elements[i]);
    }
  });
})();
