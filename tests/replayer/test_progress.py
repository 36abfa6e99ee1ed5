import io

from replayer.progress import Progress


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_off_when_not_a_tty_unless_forced():
    s = io.StringIO()
    p = Progress(10, stream=s)
    p.update(5, 1.0)
    p.close()
    assert s.getvalue() == ""
    p = Progress(10, stream=s, force=True, max_hz=0)
    p.update(5, 1.0)
    assert "5/10 requests" in s.getvalue()


def test_line_contents_and_throttle():
    s = Tty()
    p = Progress(100, stream=s, label="lpwl", max_hz=1e-9)  # at most one redraw per ~31 years
    assert p.line(25, 3600.0, 2.0) == (
        "lpwl: 25/100 requests ( 25.0%)  sim 1:00:00  wall 0:02  sim/wall 1,800x  ETA 0:06")
    p.update(1, 1.0)
    p.update(2, 2.0)  # throttled
    p.update(100, 9.0)  # the last one is always drawn
    p.close()
    out = s.getvalue()
    assert out.count("\r") == 3 and "1/100" in out and "2/100" not in out and out.endswith("\n")
