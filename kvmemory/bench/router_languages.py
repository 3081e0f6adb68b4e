"""Cross-language routing: do French and Chinese rewordings of stored English problems reach them?

The library is `generate_problems(200, seed=0)` (English, routed by problem text only, as in
`bench.router.calibrate_threshold`). Queries are hand-written French and Chinese rewordings of its first
20 problems (not machine translations of the sentences: the facts, names and numbers are kept, the
wording is the language's own), the generator's English rewording of the same 20 as the baseline, and
20 unrelated questions per language, four of them library-shaped arithmetic problems about people and
things the library does not hold (the hard negatives). The library holds near twins of every one of
the 20 (same story family, other names and numbers), so routing to the right one is not a topic match.

For each language: recall@1 (the right entry is the top hit and scores at least the threshold), top-1
accuracy with no threshold, the right entry's scores, and the false-route rate (unrelated questions
whose best score reaches the threshold). The threshold is the embedder's calibrated one
(`routing.embedders.threshold_for`), calibrated on English only: this set is a test, not a tuning set.

Run as `python -m kvmemory.bench.router_languages [--embedder minilm|multilingual|FOLDER]`; prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvmemory.routing import router as R

__all__ = ["REWORDINGS", "UNRELATED", "measure_languages"]

_NS = "lang"
_LIBRARY, _SEED = 200, 0

# entry id -> (start of its English problem text, to catch a changed generator; French; Chinese)
REWORDINGS: dict[str, tuple[str, str, str]] = {
    "s0-00000": ("Sanne has 32 boxes of onions.",
                 "Sanne possède 32 caisses d'oignons. Elle en achète 5 de plus, puis en donne 27 à une voisine. "
                 "Chaque caisse contient 9 oignons. Combien d'oignons Sanne a-t-elle à la fin ?",
                 "Sanne有32箱洋葱，又买了5箱，然后把27箱送给邻居。每箱装有9个洋葱。Sanne最后还有多少个洋葱？"),
    "s0-00001": ("For 7 days, Diego works 7 hours a day",
                 "Diego travaille comme réceptionniste à l'hôtel, 7 heures par jour pendant 7 jours, payé 9 $ de "
                 "l'heure. Il reçoit aussi une prime de 25 $. Il dépense 265 $ pour un archet de violon. Combien "
                 "d'argent lui reste-t-il ?",
                 "Diego在酒店当前台接待员，每天工作7小时，连续工作7天，每小时挣9美元，另外还得到25美元奖金。"
                 "他花265美元买了一把小提琴弓。他还剩多少钱？"),
    "s0-00002": ("There are 22 cookies on each of the 7 trays Anton bakes.",
                 "Anton fait cuire 7 plaques de 22 biscuits chacune. Il en mange d'abord 46, puis partage le reste "
                 "à parts égales entre 6 amis. Combien de biscuits reçoit chaque ami ?",
                 "Anton烤了7盘饼干，每盘22块。他先吃掉46块，再把剩下的平均分给6个朋友。每个朋友分到多少块饼干？"),
    "s0-00003": ("Beatriz takes the bus and goes 51 km each hour for 6 hours.",
                 "Beatriz conduit un bus à 51 km par heure pendant 6 heures, puis parcourt encore 109 km. Quelle "
                 "distance le bus parcourt-il en tout ?",
                 "Beatriz乘坐公交车，每小时行驶51公里，共行驶6小时，之后又行驶了109公里。公交车一共行驶了多少公里？"),
    "s0-00004": ("Mara goes to the stationery shop and picks up 8 scarves",
                 "À la papeterie, Mara achète 8 écharpes à 13 $ pièce et 8 marteaux à 11 $ pièce. Elle paie avec "
                 "200 $. Combien de monnaie lui rend-on ?",
                 "Mara在文具店买了8条围巾，每条13美元，还买了8把锤子，每把11美元。她付了200美元。她应该找回多少钱？"),
    "s0-00005": ("In his garden, Bruno puts in 5 rows of bean plants",
                 "Dans son jardin, Bruno plante 5 rangées de 10 plants de haricots. 5 plants meurent, puis il en "
                 "replante 19. Combien de plants de haricots y a-t-il à la fin ?",
                 "Bruno在花园里种了5行豆苗，每行10株。有5株死了，之后他又种了19株。最后花园里有多少株豆苗？"),
    "s0-00006": ("Malik is reading a mystery novel that has 194 pages.",
                 "Malik lit un roman policier de 194 pages. Il lit 40 pages par jour pendant 3 jours. Combien de "
                 "pages lui reste-t-il à lire ?",
                 "Malik正在读一本194页的推理小说。他连续3天每天读40页。他还剩多少页没读？"),
    "s0-00007": ("Jonas collects postcards and has 59 of them.",
                 "Jonas collectionne les cartes postales et en a 59. Pendant 9 semaines, il en ajoute 6 chaque "
                 "semaine. Ensuite il en donne 29 à un ami. Combien de cartes postales possède-t-il finalement ?",
                 "Jonas收集明信片，现在有59张。接下来9周他每周再添6张，然后送给朋友29张。Jonas最后有多少张明信片？"),
    "s0-00008": ("Victor runs a machine in a shoe factory",
                 "Victor fait tourner une machine dans une usine de chaussures qui fabrique 81 sandales par heure. "
                 "Elle fonctionne 8 heures par jour pendant 7 jours. 246 sandales sont défectueuses. Combien de "
                 "bonnes sandales sont produites ?",
                 "Victor在鞋厂操作一台机器，每小时生产81双凉鞋。机器每天运转8小时，共7天，其中246双是次品。"
                 "一共生产了多少双合格的凉鞋？"),
    "s0-00009": ("A class of 23 students visits the zoo with 2 adults",
                 "Rafael organise une sortie au zoo pour une classe de 23 élèves et 2 adultes. Le billet coûte 6 $ "
                 "pour un élève et 29 $ pour un adulte, et le zoo accorde une remise de groupe de 25 $. Combien "
                 "Rafael paie-t-il pour tous les billets ?",
                 "Rafael组织23名学生和2名成人去动物园。学生票每张6美元，成人票每张29美元，动物园给团体总价优惠25美元。"
                 "Rafael买所有门票一共要付多少钱？"),
    "s0-00010": ("A fish pond owned by Priya has a capacity of 495 litres.",
                 "Le bassin à poissons de Priya peut contenir 495 litres. Il contient au départ 54 litres d'eau. "
                 "Priya y pompe 37 litres par minute pendant 3 minutes. Combien de litres manque-t-il pour le "
                 "remplir ?",
                 "Priya的鱼池容量是495升，开始时有54升水。她用水泵每分钟注入37升，持续3分钟。鱼池还差多少升才满？"),
    "s0-00011": ("Pablo keeps 13 crates of plums in a shed.",
                 "Pablo garde 13 cageots de prunes dans un abri. Il en achète 5 autres, puis en donne 13 à un "
                 "voisin. Chaque cageot contient 20 prunes. Combien de prunes Pablo a-t-il maintenant ?",
                 "Pablo的棚子里有13箱李子。他又买了5箱，然后送给邻居13箱。每箱有20个李子。Pablo现在一共有多少个李子？"),
    "s0-00012": ("The hourly wage is $9. Priya works as a packer",
                 "Priya est emballeuse dans un entrepôt, payée 9 $ de l'heure, 8 heures par jour pendant 10 jours. "
                 "Ensuite elle s'achète une paire de bottes à 194 $. Combien de dollars lui reste-t-il ?",
                 "Priya在仓库做包装工，时薪9美元，每天工作8小时，连续10天。之后她花194美元买了一双靴子。她还剩多少美元？"),
    "s0-00013": ("Lukas makes 6 trays of cupcakes",
                 "Lukas prépare 6 plateaux de 15 cupcakes. Il en mange d'abord 18, puis répartit le reste "
                 "également entre 6 amis. Combien de cupcakes chaque ami reçoit-il ?",
                 "Lukas做了6盘纸杯蛋糕，每盘15个。他先吃了18个，再把剩下的平均分给6个朋友。每个朋友能得到多少个纸杯蛋糕？"),
    "s0-00014": ("For 4 hours, Dmitri's tractor travels at 83 kilometres per hour.",
                 "Le tracteur de Dmitri roule à 83 km/h pendant 4 heures, puis fait encore 99 km. Le lendemain, il "
                 "refait exactement le même trajet. Combien de kilomètres parcourt-il au total ?",
                 "Dmitri开拖拉机以每小时83公里的速度行驶4小时，然后又开了99公里。第二天他把整段路程重复一遍。"
                 "他一共行驶了多少公里？"),
    "s0-00015": ("Rosa purchases 4 puzzles ($8 each)",
                 "Au magasin de jouets, Rosa achète 4 puzzles à 8 $ chacun et 2 tasses à 3 $ chacune. Elle paie "
                 "avec 50 $. Combien de monnaie récupère-t-elle ?",
                 "Rosa在玩具店买了4个拼图，每个8美元，还有2个马克杯，每个3美元。她付了50美元。应该找给她多少钱？"),
    "s0-00016": ("In his garden, Sefa puts in 11 rows of bean plants",
                 "Sefa plante 11 rangées de 20 plants de haricots dans son jardin. Le gel en tue 22, puis Sefa en "
                 "replante 20. Combien de plants de haricots reste-t-il dans le jardin à la fin ?",
                 "Sefa在花园里种了11行豆苗，每行20株。一场霜冻冻死了22株，之后Sefa又补种了20株。最后花园里有多少株豆苗？"),
    "s0-00017": ("Victor is reading an atlas that has 220 pages.",
                 "Victor lit un atlas de 220 pages. Il lit 21 pages par jour pendant 9 jours. Combien de pages lui "
                 "reste-t-il à lire ?",
                 "Victor在读一本220页的地图集，9天里每天读21页。他还有多少页没读？"),
    "s0-00018": ("Tariq starts with 77 stamps in an album.",
                 "Tariq a 77 timbres dans un album. Chaque semaine pendant 5 semaines, il en ajoute 10. Plus tard "
                 "il en donne 13 à un camarade de classe. Combien de timbres Tariq possède-t-il à la fin ?",
                 "Tariq的集邮册里有77枚邮票。连续5周他每周新增10枚，后来送给同学13枚。Tariq最后有多少枚邮票？"),
    "s0-00019": ("At the print shop where Leila works",
                 "Dans l'imprimerie où travaille Leila, une machine produit 63 affiches par heure, 8 heures par "
                 "jour pendant 4 jours. 173 affiches sont défectueuses et jetées. Combien d'affiches utilisables "
                 "la machine produit-elle ?",
                 "Leila工作的印刷店里，一台机器每小时印63张海报，每天运转8小时，共4天。其中173张有缺陷被扔掉。"
                 "这台机器共印出多少张可用的海报？"),
}

# Questions the library cannot answer; the last four of each are library-shaped (hard negatives).
UNRELATED: dict[str, list[str]] = {
    "fr": [
        "Pourquoi le ciel est-il bleu ?", "Que devrais-je cuisiner ce soir ?", "Que fait la commande git rebase ?",
        "Comment enlever une tache de vin rouge sur un tapis ?", "7297 est-il un nombre premier ?",
        "Quelle est la monnaie du Mexique ?", "Raconte-moi une blague sur les loutres.",
        "Comment inverser une liste en Python ?", "Quels sont les symptômes de la grippe ?",
        "Quelle est la capitale de l'Australie ?", "Comment fonctionne un moteur électrique ?",
        "Qui a écrit Les Misérables ?", "Quelle heure est-il à Tokyo ?", "Comment faire une pâte à crêpes ?",
        "Combien de temps faut-il pour apprendre le piano ?",
        "Quelle est la différence entre un virus et une bactérie ?",
        "Zébulon emprunte une carte du ciel de 428 pages. Il en a déjà lu 38 et lit 24 pages par jour pendant "
        "8 jours. Combien de pages lui reste-t-il ?",
        "Un train part à 15 h et roule à 80 km/h. À quelle heure arrive-t-il à une gare située à 200 km ?",
        "Léonie a 14 ans et son frère a le double de son âge moins 5 ans. Quel âge a son frère ?",
        "Un rectangle mesure 12 cm sur 7 cm. Quelle est son aire ?",
    ],
    "zh": [
        "天空为什么是蓝色的？", "我今晚应该做什么晚饭？", "git rebase 是做什么的？", "怎样去除地毯上的红酒渍？",
        "7297是质数吗？", "墨西哥的货币是什么？", "讲一个关于水獭的笑话。", "在Python中怎样反转一个列表？",
        "流感有哪些症状？", "澳大利亚的首都是哪里？", "电动机是怎样工作的？", "《红楼梦》的作者是谁？",
        "东京现在几点？", "怎么包饺子？", "学钢琴需要多长时间？", "病毒和细菌有什么区别？",
        "Zebulon借了一本428页的星图，他已经读了38页，接下来8天每天读24页。还剩多少页没读？",
        "一列火车下午3点出发，以每小时80公里的速度行驶。它几点到达200公里外的车站？",
        "小红今年14岁，她哥哥的年龄是她的两倍减5岁。她哥哥几岁？",
        "一个长方形长12厘米，宽7厘米，它的面积是多少？",
    ],
}


def _queries() -> tuple[list[Any], dict[str, list[tuple[str, str]]]]:
    """The library and, per language, (expected entry id, query) pairs; checks the generator still
    makes the problems the rewordings were written for."""
    from kvmemory.bench.problems import generate_problems

    library = generate_problems(_LIBRARY, _SEED, rewordings=1)
    by_id = {p.id: p for p in library}
    related: dict[str, list[tuple[str, str]]] = {"en": [], "fr": [], "zh": []}
    for pid, (start, fr, zh) in REWORDINGS.items():
        p = by_id.get(pid)
        if p is None or not p.text.startswith(start):
            raise RuntimeError(f"generate_problems({_LIBRARY}, {_SEED}) no longer makes {pid} as {start!r}...; "
                               "the hand-written rewordings in bench/router_languages.py need updating")
        related["en"].append((pid, p.rewordings[0]))
        related["fr"].append((pid, fr))
        related["zh"].append((pid, zh))
    return library, related


def measure_languages(embedder: R.Embedder | str | None = None, threshold: float | None = None) -> dict[str, Any]:
    """Route the rewordings and unrelated questions of each language; see the module docstring."""
    emb = R.resolve_embedder(embedder)
    thr = R.threshold_for(emb, warn=False) if threshold is None else float(threshold)
    library, related = _queries()
    out: dict[str, Any] = {"embedder": emb.name, "embedder_spec": emb.spec,
                           "calibrated": emb.identity["weights_sha256"] in R.CALIBRATED_THRESHOLDS,
                           "threshold": thr, "library": len(library), "languages": {}}
    with tempfile.TemporaryDirectory() as d:
        router = R.Router(os.path.join(d, "router"), emb, threshold=thr)
        router.add_many([(p.id, _NS, [p.text]) for p in library], progress=False)
        for lang in ("en", "fr", "zh"):
            pairs = related[lang]
            vecs = emb.embed([q for _, q in pairs])
            top_ok, right_scores, recalled = [], [], []
            for (pid, _), v in zip(pairs, vecs):
                hits = router.search_vector(v, len(library), _NS, -2.0)
                right = next(h.score for h in hits if h.entry_id == pid)
                top_ok.append(hits[0].entry_id == pid)
                right_scores.append(right)
                recalled.append(hits[0].entry_id == pid and hits[0].score >= thr)
            res: dict[str, Any] = {
                "queries": len(pairs),
                "recall_at_1": sum(recalled) / len(pairs),
                "top1_accuracy_no_threshold": sum(top_ok) / len(pairs),
                "right_score_min": float(min(right_scores)),
                "right_score_median": float(np.median(right_scores)),
            }
            if lang in UNRELATED:
                unr = UNRELATED[lang]
                best = [router.search_vector(v, 1, _NS, -2.0)[0].score for v in emb.embed(unr)]
                res.update({"unrelated": len(unr), "false_route_rate": sum(s >= thr for s in best) / len(unr),
                            "unrelated_score_max": float(max(best)),
                            "unrelated_score_median": float(np.median(best))})
            out["languages"][lang] = res
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvmemory.bench.router_languages",
                                description="route French and Chinese rewordings of stored English problems")
    p.add_argument("--embedder", help="minilm (default), multilingual, a sentence-transformers folder or cached hub id")
    p.add_argument("--threshold", type=float, help="instead of the embedder's calibrated threshold")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    print(json.dumps(measure_languages(a.embedder, a.threshold), indent=1, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
