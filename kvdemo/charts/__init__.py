"""Chart data and figures from records only, never from a live cache: a session's steps (`steps`), the
reports of a comparison (`reports`) and of a needle grid (`needle`), the rotation's why for the notebooks (`rotation`),
and what their data frames share (`frames`)."""
