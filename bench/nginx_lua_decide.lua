-- The NGINX + ngx_lua benchmark peer's access phase: one EVALSHA of scripts/decide.lua per request
-- on a pooled cosocket, the way OpenResty limiters (Kong's redis policy) talk to Redis. A minimal
-- RESP client, so the peer needs nothing beyond Debian's libnginx-mod-http-lua.
local _M = {}

local RATE, BURST = "1000000000", "1000000000"

local function bulk(s)
  return "$" .. #s .. "\r\n" .. s .. "\r\n"
end

local function fail(status, err)
  ngx.log(ngx.ERR, "decide: ", err)
  return ngx.exit(status)
end

function _M.access()
  local sock = ngx.socket.tcp()
  sock:settimeout(1000)
  local ok, err = sock:connect("127.0.0.1", tonumber(ngx.var.redis_port))
  if not ok then
    return fail(503, err)
  end
  -- The key Turnstile builds for route "bench", policy "never_trips", keyed by client IP.
  local key = "bench:{bench:never_trips:" .. ngx.var.remote_addr .. "}:tb"
  local req = "*11\r\n" .. bulk("EVALSHA") .. bulk(ngx.var.decide_sha) .. bulk("1") .. bulk(key)
    .. bulk("") .. bulk("tb") .. bulk(RATE) .. bulk(BURST) .. bulk("0") .. bulk("1") .. bulk("0")
  ok, err = sock:send(req)
  if not ok then
    return fail(503, err)
  end
  local line
  line, err = sock:receive()
  if not line then
    return fail(503, err)
  end
  if line:sub(1, 1) ~= "*" then
    return fail(500, line)
  end
  local allowed = false
  for i = 1, tonumber(line:sub(2)) do
    local item
    item, err = sock:receive()
    if not item then
      return fail(503, err)
    end
    if i == 1 then
      allowed = item == ":1"
    end
  end
  sock:setkeepalive(60000, 256)
  if not allowed then
    return ngx.exit(429)
  end
end

return _M
