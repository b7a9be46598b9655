// The console's one script: the live refresh. Every element with data-refresh="URL"
// has its contents replaced by that URL's fragment every few seconds, so a key another
// operator took shows up held, by whom, without a reload. The fragment's ETag (the
// page gives the first in data-refresh-tag) is sent back as If-None-Match: a table that
// did not change is answered 304 with no body, and only its ages are counted on here, from each row's data-since-ms and
// the server's clock (the table's data-read-ms when it was drawn). Everything else on
// the console is links and plain form posts, and works with this script off.
(function () {
  "use strict";
  var PERIOD_MS = 3000;

  function say(text) {
    var note = document.getElementById("refresh-note");
    if (note) {
      note.textContent = text;
    }
  }

  // `45s`, `3m 12s`, `2h 5m`, `3d 4h`: as the server's `age` filter writes it.
  function age(seconds) {
    var whole = Math.max(0, Math.floor(seconds));
    var days = Math.floor(whole / 86400);
    var hours = Math.floor((whole % 86400) / 3600);
    var minutes = Math.floor((whole % 3600) / 60);
    var secs = whole % 60;
    if (days) {
      return days + "d " + hours + "h";
    }
    if (hours) {
      return hours + "h " + minutes + "m";
    }
    if (minutes) {
      return minutes + "m " + secs + "s";
    }
    return secs + "s";
  }

  // The server's now, as this browser's clock runs: the table says when it was read.
  function learnClock(element) {
    var table = element.querySelector("[data-read-ms]");
    var read = table ? Number(table.getAttribute("data-read-ms")) : 0;
    if (read > 0) {
      element.refreshOffset = Date.now() - read;
    }
  }

  function countAges(element) {
    if (element.refreshOffset === undefined) {
      return;
    }
    var now = Date.now() - element.refreshOffset;
    var cells = element.querySelectorAll("[data-since-ms]");
    for (var i = 0; i < cells.length; i += 1) {
      var since = Number(cells[i].getAttribute("data-since-ms"));
      if (since > 0) {
        cells[i].textContent = age((now - since) / 1000);
      }
    }
  }

  function refresh(element) {
    if (document.hidden) {
      window.setTimeout(refresh, PERIOD_MS, element);
      return;
    }
    var headers = { Accept: "text/html" };
    if (element.refreshTag) {
      headers["If-None-Match"] = element.refreshTag;
    }
    fetch(element.getAttribute("data-refresh"), {
      credentials: "same-origin",
      cache: "no-store",
      redirect: "error",
      headers: headers,
    })
      .then(function (response) {
        if (response.status === 401) {
          // Signed out (expired, or removed from the operators): stop, and say so.
          element.setAttribute("data-refresh-stopped", "signed out");
          say("Signed out: live refresh stopped. Reload the page to sign in again.");
          return null;
        }
        if (response.status === 304) {
          return "";  // unchanged: keep the rows, count their ages on
        }
        if (response.status !== 200) {
          throw new Error("HTTP " + response.status);
        }
        element.refreshTag = response.headers.get("ETag") || "";
        return response.text();
      })
      .then(function (html) {
        if (html === null) {
          return;
        }
        if (html !== "") {
          // Parsed as an inert document: nothing in it runs, and the server escaped it.
          var parsed = new DOMParser().parseFromString(html, "text/html");
          element.replaceChildren.apply(element, Array.prototype.slice.call(parsed.body.childNodes));
          learnClock(element);
        } else {
          countAges(element);
        }
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
      elements[i].refreshTag = elements[i].getAttribute("data-refresh-tag") || "";
      learnClock(elements[i]);
      window.setTimeout(refresh, PERIOD_MS, elements[i]);
    }
  });
})();
