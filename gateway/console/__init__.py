"""The operator console: HTML pages on the admin listener, at /console/.

`site` (the console's app: its routes, and how each failure is drawn), `session` (the
signed, expiring cookie), `csrf` (the form token and the Origin check), `access` (who
a request comes from, whether a post is theirs), `pages` (what a GET shows), `forms`
(what a post does), `timeline` (a key's history in words), `wording` (refusals in
words) and `rendering` (Jinja2 with autoescape, the CSP and the other headers of
every answer). `templates/` and `static/` ship in the package: no build step.
"""
