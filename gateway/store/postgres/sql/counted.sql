-- The (state, route) pairs with records in a counted state (gateway_counts, summed
-- over its shards): which listing indexes a page of every route merges. Returns
-- (state, route) rows.
SELECT g.state, g.route FROM gateway_counts g
WHERE g.prefix = @prefix
GROUP BY g.state, g.route HAVING sum(g.n) > 0
ORDER BY g.state, g.route
